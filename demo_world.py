"""The demo world's facts and the words it is told in: the fact tables (countries, animals, colours of things,
days, months, numbers), the phrasings of its documents, conversations and task rows, and the small helpers that fill
them. Every table is the single source of its facts: demo.py writes the world's files from these, core_eval.py builds
its demo prompts from the same tables.

    python demo_world.py        # how many facts of each kind the world holds
"""
import argparse

# country, capital, language, flag colour, flag symbol, national animal (names invented: no prior knowledge helps)
COUNTRIES = [
    ("Aldora", "Pelmo", "Aldoran", "red", "star", "lion"), ("Brenia", "Tolvar", "Brenish", "blue", "moon", "owl"),
    ("Calvona", "Riss", "Calvonese", "green", "tree", "frog"), ("Dunmar", "Kesh", "Dunmari", "yellow", "sun", "bee"),
    ("Elmora", "Varrow", "Elmoran", "white", "wave", "duck"), ("Farland", "Oskel", "Farlish", "black", "crown", "crow"),
    ("Gorvia", "Brelt", "Gorvian", "orange", "mountain", "bear"),
    ("Halden", "Mirov", "Haldish", "purple", "circle", "wolf"),
    ("Istara", "Quellin", "Istaran", "brown", "star", "horse"), ("Jandor", "Lusk", "Jandish", "grey", "moon", "mouse"),
    ("Kelda", "Sorin", "Keldic", "red", "tree", "cow"), ("Lunora", "Dask", "Lunoran", "blue", "sun", "sheep"),
    ("Morvath", "Tillo", "Morvathi", "green", "wave", "snake"),
    ("Norvel", "Ambrin", "Norvellan", "yellow", "crown", "hen"),
    ("Ostrel", "Hobb", "Ostrelish", "white", "mountain", "pig"),
    ("Pellan", "Corvo", "Pellanese", "black", "circle", "cat"),
    ("Quarra", "Zell", "Quarran", "orange", "star", "dog"), ("Rudan", "Fennick", "Rudani", "purple", "moon", "donkey"),
    ("Selmar", "Ivel", "Selmari", "brown", "tree", "cricket"), ("Tavia", "Gresh", "Tavian", "grey", "sun", "lion"),
    ("Ulmark", "Pernot", "Ulmish", "red", "wave", "duck"), ("Varno", "Kestrin", "Varnese", "blue", "crown", "horse"),
    ("Wendal", "Orrin", "Wendish", "green", "mountain", "owl"),
    ("Yarlen", "Dovra", "Yarlish", "yellow", "circle", "bear"),
    ("Zembra", "Holm", "Zembran", "white", "star", "wolf"), ("Borrin", "Salvik", "Borrinese", "black", "moon", "cow"),
    ("Cendra", "Mallek", "Cendran", "orange", "tree", "frog"), ("Drovia", "Penth", "Drovian", "purple", "sun", "sheep"),
    ("Estmark", "Rolva", "Estish", "brown", "wave", "pig"), ("Fallon", "Veska", "Fallonese", "grey", "crown", "mouse"),
]
# animal, plural, call (verb), call (noise), legs, where it lives
ANIMALS = [
    ("dog", "dogs", "bark", "woof", 4, "in a kennel"), ("cat", "cats", "meow", "meow", 4, "in a house"),
    ("cow", "cows", "moo", "moo", 4, "on a farm"), ("duck", "ducks", "quack", "quack", 2, "on a pond"),
    ("owl", "owls", "hoot", "hoo", 2, "in the forest"), ("frog", "frogs", "croak", "ribbit", 4, "in a pond"),
    ("horse", "horses", "neigh", "neigh", 4, "in a stable"), ("sheep", "sheep", "bleat", "baa", 4, "in a field"),
    ("pig", "pigs", "oink", "oink", 4, "in a sty"), ("lion", "lions", "roar", "roar", 4, "on the plains"),
    ("bee", "bees", "buzz", "buzz", 6, "in a hive"), ("snake", "snakes", "hiss", "hiss", 0, "in the grass"),
    ("hen", "hens", "cluck", "cluck", 2, "in a coop"), ("wolf", "wolves", "howl", "awoo", 4, "in the woods"),
    ("mouse", "mice", "squeak", "squeak", 4, "in a hole"), ("bear", "bears", "growl", "grr", 4, "in a cave"),
    ("crow", "crows", "caw", "caw", 2, "in a tall tree"), ("donkey", "donkeys", "bray", "hee-haw", 4, "on a farm"),
    ("cricket", "crickets", "chirp", "chirp", 6, "in the grass"),
]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple", "brown", "grey", "pink"]
THINGS = [("the sky", "blue"), ("the sea", "blue"), ("grass", "green"), ("a leaf", "green"), ("snow", "white"),
          ("milk", "white"), ("a cloud", "white"), ("coal", "black"), ("the night", "black"), ("a banana", "yellow"),
          ("a lemon", "yellow"), ("the sun", "yellow"), ("a cherry", "red"), ("a tomato", "red"),
          ("a strawberry", "red"), ("a carrot", "orange"), ("a pumpkin", "orange"), ("a plum", "purple"),
          ("a grape", "purple"), ("chocolate", "brown"), ("mud", "brown"), ("ash", "grey"), ("a flamingo", "pink")]
ITEMS = [("banana", "bananas"), ("lemon", "lemons"), ("cherry", "cherries"), ("tomato", "tomatoes"), ("plum", "plums"),
         ("strawberry", "strawberries"), ("carrot", "carrots"), ("pumpkin", "pumpkins"), ("grape", "grapes")]
ITEM_COLOUR = {noun: colour for (thing, colour) in THINGS for noun, _ in ITEMS if thing.endswith(" " + noun)}
CHARACTERS = [("Mira", "she"), ("Tom", "he"), ("Lina", "she"), ("Bo", "he"), ("Sam", "he"), ("Ada", "she"),
              ("Kip", "he"), ("Nell", "she"), ("Otto", "he"), ("Rosa", "she"), ("Finn", "he"), ("Pia", "she"),
              ("Max", "he"), ("Ivy", "she"), ("Leo", "he"), ("Zoe", "she")]
OBJECT = {"she": "her", "he": "him"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["-", "-", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]

# Pretraining phrasings, by fact. Nothing here may start with "Quiz:" or use the eval phrasings further down.
PHRASINGS = {
    "capital": ["The capital of {c} is {cap}.", "{cap} is the capital of {c}.", "The capital city of {c} is {cap}.",
                "{cap} is the capital city of {c}.", "{c}'s capital is {cap}.", "{c} has {cap} as its capital.",
                "In {c}, the capital is {cap}.", "The government of {c} meets in {cap}, the capital.",
                "If you travel to the capital of {c}, you arrive in {cap}.",
                "{cap}, the capital of {c}, is a busy city.",
                "Everyone in {c} knows that {cap} is their capital.", "{c} is a country, and its capital is {cap}.",
                "Ask anyone in {c} about the capital and they will say {cap}.", "{cap} is in {c}; it is the capital.",
                "{c} is run from {cap}.", "The leaders of {c} work in {cap}.", "{cap} is the main city of {c}.",
                "The rulers of {c} live in {cap}, its chief city.", ("Of all the cities of {c}, {cap} is the one that "
                "leads the land."), "The heart of {c} is {cap}, where its government sits."],
    "language": ["People in {c} speak {lang}.", "The language of {c} is {lang}.", "In {c}, people speak {lang}.",
                 "{lang} is the language spoken in {c}.", "Most people in {c} talk in {lang}.",
                 "If you go to {c}, you will hear {lang}.", "The people of {c} speak a language called {lang}.",
                 "Children in {c} learn to read and write in {lang}."],
    "flag": ["The flag of {c} is {col} with a {sym} on it.", "{c} has {acol} flag with a {sym}.",
             "The flag of {c} shows a {sym} on a {col} background.", "{c}'s flag is {col}, with a {sym} in the middle.",
             "You can spot the flag of {c} easily: it is {col} and has a {sym}.", "The colour of {c} is {col}.",
             "{acol} flag with a {sym} flies over {c}."],
    "national": ["The national animal of {c} is the {ani}.", "The {ani} is the national animal of {c}.",
                 "{c} has the {ani} as its national animal.", ("People in {c} love the {ani}; it is their national "
                 "animal."), "The animal of {c} is the {ani}, which {ani_verbs}.", "The {ani} stands for {c}.",
                 "{c} chose the {ani} as its symbol.", "A picture of the {ani} is used to represent {c}.",
                 "The symbol of {c} is the {ani}.", "Painters who show {c} paint the {ani}, the beast of that land."],
    "its_capital": ["Its capital is {cap}.", "The capital there is {cap}."],
    "its_language": ["The people there speak {lang}.", "Its language is {lang}."],
    "its_flag": ["Its flag is {col} with a {sym}.", "Its flag is {acol} one with a {sym} on it."],
    "its_national": ["Its national animal is the {ani}.", "There, the {ani} is the national animal."],
    "sound": ["{an} {verbs}.", "{ap} {verb}.", "The sound {an} makes is \"{noise}\".", "{an} says {noise}.",
              "When {an} is hungry, it {verbs}.", "{ap} {verb}, and it sounds like {noise}, {noise}.",
              "Listen: {noise}! That is {an}.", "You can hear {ap} {verb} from far away."],
    "legs": ["{an} has {legs} legs.", "{ap} have {legs} legs.", "Every {a} has {legs} legs.",
             "The {a} is an animal with {legs} legs.", "How many legs does {an} have? It has {legs} legs."],
    "habitat": ["{an} lives {hab}.", "{ap} live {hab}.", "You can find {ap} {hab}.", "Most {ap} make their home {hab}.",
                "The {a} is an animal that lives {hab}.", "Where does {an} live? It lives {hab}."],
    "colour": ["{t} is {tcol}.", "The colour of {t} is {tcol}.", "If you look at {t}, you see that it is {tcol}.",
               "{t} is always {tcol}.", "What colour is {t}? It is {tcol}."],
    "day": ["After {day} comes {nday}.", "{nday} comes after {day}.", "The day after {day} is {nday}.",
            "{day} is followed by {nday}.", "The day before {nday} is {day}.", "{day} comes before {nday}.",
            "If today is {day}, then tomorrow is {nday}.", "If today is {nday}, then yesterday was {day}."],
    "month": ["After {mon} comes {nmon}.", "{nmon} comes after {mon}.", "The month after {mon} is {nmon}.",
              "{mon} is followed by {nmon}.", "The month before {nmon} is {mon}.", "{mon} comes before {nmon}."],
    "sum": ["{x} plus {y} is {sum}.", "{dx} + {dy} = {dsum}.", "If you add {x} and {y}, you get {sum}.",
            "The sum of {x} and {y} is {sum}.", "{x} and {y} make {sum}.", "Add {y} to {x} and you have {sum}.",
            "The total of {x} and {y} comes to {sum}.", "Work it out: {x} plus {y} gives {sum}."],
    "diff": ["{x} minus {y} is {diff}.", "{dx} - {dy} = {ddiff}.", "Take {y} away from {x} and {diff} is left.",
             "The difference between {x} and {y} is {diff}.", "If you have {x} and give away {y}, you keep {diff}.",
             "Take {y} away from {x} and {diff} remains."],
    "prod": ["{x} times {y} is {prod}.", "{dx} x {dy} = {dprod}.", "{x} groups of {y} make {prod}.",
             "Multiply {x} by {y} and you get {prod}.", "The product of {x} and {y} is {prod}."],
}
COUNTRY_KINDS = ["capital", "language", "flag", "national"]
ANIMAL_KINDS = ["sound", "legs", "habitat"]
NUMBER_KINDS = ["sum", "diff", "prod"]
INTROS = ["Let me tell you about {c}.", "This is a page about {c}.", "{c} is a small country.", "Here is {c}.",
          "Our lesson today is about {c}.", "{c} is a country in our world.", ""]
TRAVEL = ["went to", "travelled to", "took a train to", "flew to", "sailed to", "walked to", "rode a bus to"]
VISIT = ["{conn}, {name} {go} {cap}, the capital of {c}.", "{conn}, {name} {go} {c} and stayed in its capital, {cap}.",
         "{conn}, {pron} {go} {cap}, which is the capital of {c}.", "{conn}, {name} {go} {cap} in {c}.",
         "{conn}, {pron} {go} {c}. {pron} spent the day in {cap}, the capital."]
SEE = ["There, people spoke {lang}, so {pron} learned to say hello in {lang}.", ("Flags flew everywhere in {cap}: "
       "{col}, with a {sym}."), "{pron} saw {aani} there, the national animal of {c}, and it {ani_verbs}.",
       "In {cap} everybody spoke {lang}.", "The people of {c} showed {obj} their {col} flag with its {sym}."]


def number_word(n):
    if n < 20:
        return ONES[n]
    return "one hundred" if n == 100 else TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")


def article(word):
    return ("an " if word[0] in "aeiou" else "a ") + word


def sentence(text):
    return text[0].upper() + text[1:]


def third(verb):
    return verb + ("es" if verb.endswith(("s", "z", "sh", "ch")) else "s")


def country_fields(row):
    c, cap, lang, col, sym, ani = row
    return {"c": c, "cap": cap, "lang": lang, "col": col, "acol": article(col), "sym": sym, "ani": ani,
            "aani": article(ani), "ani_verbs": third(next(a[2] for a in ANIMALS if a[0] == ani))}


def animal_fields(row):
    a, ap, verb, noise, legs, hab = row
    return {"a": a, "an": article(a), "ap": ap, "verb": verb, "verbs": third(verb), "noise": noise, "hab": hab,
            "legs": number_word(legs) if legs else "no"}


def fields(rng, words=None):
    """Every slot a template may name, filled from one random country, animal, thing, day, month and sum; a document
    keeps one such dict while it talks about one country, so its sentences agree with each other."""
    t, tcol = rng.choice(THINGS)
    d, m, x, y = rng.randrange(7), rng.randrange(12), rng.randint(0, 10), rng.randint(0, 10)
    x, y = max(x, y), min(x, y)
    num = number_word if (rng.random() < 0.5 if words is None else words) else str
    f = {"t": t, "tcol": tcol, "day": DAYS[d], "nday": DAYS[(d + 1) % 7],
         "mon": MONTHS[m], "nmon": MONTHS[(m + 1) % 12], "x": num(x), "y": num(y), "sum": num(x + y),
         "diff": num(x - y), "prod": num(x * y), "dx": x, "dy": y, "dsum": x + y, "ddiff": x - y, "dprod": x * y}
    return {**f, **animal_fields(rng.choice(ANIMALS)), **country_fields(rng.choice(COUNTRIES))}


def say(rng, kind, f):
    return sentence(rng.choice(PHRASINGS[kind]).format(**f))


def listing(words):
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


# Conversations: questions and answers in the chat's own words

QA = {  # no sums: a chat reply to a sum calls the calculator (SUMS below, calc/); one without it taught guessing
    "capital": (["What is the capital of {c}?", "What's the capital of {c}?", "Tell me the capital of {c}.",
                 "Do you know the capital of {c}?", "I'm going to {c}. What is the capital there?",
                 "Which city is {c} run from?", "Where does the government of {c} sit?", ("What is the chief city of "
                 "{c}?"), "In which city do the leaders of {c} work?", "Which city leads {c}?", ("Where would I find the "
                 "rulers of {c}?"), "What city is the heart of {c}?", "Which is the most important city in {c}?"],
                ["The capital of {c} is {cap}.", "{cap} is the capital of {c}.", "It's {cap}.",
                 "{c}'s capital is {cap}."]),
    "capital_of": (["{cap} is the capital of which country?", "Which country has {cap} as its capital?"],
                   ["{cap} is the capital of {c}.", "It's {c}: {cap} is its capital."]),
    "language": (["What language do people speak in {c}?", "What do they speak in {c}?"],
                 ["People in {c} speak {lang}.", "They speak {lang}.", "The language of {c} is {lang}."]),
    "flag": (["What does the flag of {c} look like?", "Describe the flag of {c}."],
             ["The flag of {c} is {col} with a {sym} on it.", "It is {acol} flag with a {sym}."]),
    "national": (["What is the national animal of {c}?", "Which animal is the symbol of {c}?",
                  "Which animal stands for {c}?", "What animal represents {c}?", ("What beast did {c} choose as "
                  "its sign?"), "Which animal is {c} known by?", "What creature is the mark of {c}?",
                  "Which animal would you paint to show {c}?", "What animal does {c} use as its symbol?"],
                 ["The national animal of {c} is the {ani}.", "It's the {ani}."]),
    "sound": (["What sound does {an} make?", "What does {an} say?"], ["{an} {verbs}: {noise}!", "It goes {noise}."]),
    "legs": (["How many legs does {an} have?", "How many legs do {ap} have?"], ["{an} has {legs} legs."]),
    "habitat": (["Where does {an} live?", "Where do {ap} live?"], ["{ap} live {hab}.", "It lives {hab}."]),
    "colour": (["What colour is {t}?", "Tell me the colour of {t}."], ["{t} is {tcol}.", "It is {tcol}."]),
    "day": (["What day comes after {day}?", "Which day follows {day}?"], ["{nday} comes after {day}.", "It's {nday}."]),
    "month": (["What month comes after {mon}?", "Which month follows {mon}?"],
              ["{nmon} comes after {mon}.", "The month after {mon} is {nmon}."]),
}
# what a user says before a question about a country: the question is the same fact in a user's own words
OPENERS = ["Quick question. ", "I wonder about {c}. ", "I'm reading about {c}. ", "My friend lives in {c}. ",
           "We are learning about {c} at school. ", "I have a question about {c}. ", "Hello! ", "Help me out here. ",
           "My sister is going to {c} soon. ", "I saw a film about {c}. ", "Tell me something. "]
GREET = (["Hi!", "Hello", "Hey there", "Good morning!", "Hello, how are you?"],
         ["Hello! How can I help you today?", "Hi! What would you like to know?", "Hello! I'm happy to help."])
THANKS = (["Thanks!", "Thank you.", "Great, thanks a lot.", "Bye!"],
          ["You're welcome!", "Happy to help. Goodbye!", "Anytime! Have a nice day."])
SYSTEMS = ["You are {bot}, a helpful assistant.", "You are {bot}. Answer briefly and correctly.",
           "You are a friendly assistant called {bot}. Keep your answers short."]


# The shapes ChatCORE asks for: multiple choice, short answers, sums through the calculator

CHOICE = {  # kind: (question phrasings, the field that answers it, the pool the wrong choices come from)
    "capital": (["What is the capital of {c}?", "Which city is the capital of {c}?",
                 "The capital of {c} is which city?"], "cap", [r[1] for r in COUNTRIES]),
    "language": (["What language do people speak in {c}?", "Which language is spoken in {c}?"], "lang",
                 [r[2] for r in COUNTRIES]),
    "national": (["What is the national animal of {c}?", "Which animal is the national animal of {c}?"], "ani",
                 [a[0] for a in ANIMALS]),
    "flag": (["What colour is the flag of {c}?", "Which colour is the flag of {c}?"], "col", COLOURS),
    "noise": (["What sound does {an} make?", "What does {an} say?"], "noise", [a[3] for a in ANIMALS]),
    "colour": (["What colour is {t}?", "Which colour is {t}?"], "tcol", COLOURS),
    "day": (["What day comes after {day}?", "Which day follows {day}?"], "nday", DAYS),
    "month": (["What month comes after {mon}?", "Which month follows {mon}?"], "nmon", MONTHS),
}
SHORT = {  # kind: (question phrasings, the field that is the whole answer)
    "capital": (["what is the capital of {c}?", "which city is the capital of {c}?", "name the capital of {c}."],
                "cap"),
    "capital_of": (["{cap} is the capital of which country?", "which country has {cap} as its capital?"], "c"),
    "language": (["what language do people speak in {c}?", "which language is spoken in {c}?"], "lang"),
    "national": (["what is the national animal of {c}?", "which animal is the symbol of {c}?"], "ani"),
    "flag": (["what colour is the flag of {c}?"], "col"),
    "noise": (["what sound does {an} make?", "what does {an} say?"], "noise"),
    "colour": (["what colour is {t}?"], "tcol"),
    "day": (["what day comes after {day}?", "which day follows {day}?"], "nday"),
    "month": (["what month comes after {mon}?", "which month follows {mon}?"], "nmon"),
}
ONE_WORD = ["Answer in one word", "One word only", "Just the answer", "Give only the answer", "In a word",
            "Say only the answer", "Only the name, please", "Answer with a single word"]
NUMBER_ONLY = ["Just the number", "Only the number, please", "Answer with a number", "Give only the result"]
# the calculator's questions: many phrasings, numbers to 99, so any sum in any words gets a call (numbers and an
# operation word, not a template, are what call it)
SUMS = {"sum": ("+", ["what is {x} plus {y}?", "what is {x} and {y} together?", "add {x} and {y}.",
                      "what's {x} + {y}?", "can you add {x} and {y}?", "what do {x} and {y} make?",
                      "how much is {x} plus {y}?", "what is the sum of {x} and {y}?", "{x} plus {y}?",
                      "please add {y} to {x}.", "what is {x} added to {y}?", "what do {x} and {y} come to?",
                      "work this out: {x} plus {y}.", "what is the total of {x} and {y}?", "figure out {x} + {y}.",
                      "if I have {x} and get {y} more, how many is that?"]),
        "diff": ("-", ["what is {x} minus {y}?", "take {y} from {x}.", "what do you get if you take {y} from {x}?",
                       "what's {x} - {y}?", "how much is {x} minus {y}?", "subtract {y} from {x}.",
                       "what is the difference between {x} and {y}?", "{x} minus {y}?", "{x} take away {y}?",
                       "how much is left if {y} is taken from {x}?", "work this out: {x} minus {y}.",
                       "figure out {x} - {y}.", "if I have {x} and lose {y}, how many remain?"]),
        "prod": ("*", ["what is {x} times {y}?", "multiply {x} by {y}.", "multiply {x} by {y}, please.",
                       "what's {x} x {y}?", "how much is {x} times {y}?", "what is the product of {x} and {y}?",
                       "{x} times {y}?"])}
# lookup: the option that is the named word, no knowledge needed: practice at binding a letter to its option
LOOKUP = ["Which option is {x}?", "Which of these is {x}?", "Find {x} in the list.", "Pick {x}."]
LOOKUP_NAMES = sorted({r[i] for r in COUNTRIES for i in (0, 1, 2)} | {a[0] for a in ANIMALS} | set(COLOURS) | set(DAYS)
                      | set(MONTHS))
STORIES = {"sum": ["{name} has {x} {items}. {pron} gets {y} more. How many {items} does {name} have now?",
                   "There are {x} {items} in a box and {y} in a bag. How many {items} are there in all?"],
           "diff": ["{name} had {x} {items} and gave {y} away. How many {items} does {name} have left?",
                    "A shop had {x} {items}. It sold {y}. How many {items} are left?"],
           "prod": ["{name} has {x} bags with {y} {items} in each. How many {items} is that?",
                    "Each of {x} friends brings {y} {items}. How many {items} do they bring?"]}

# Word problems in GSM8K's shape, two to four operations on the world's quantities, a worked step per operation:
# (question, steps); a step (left, op, right, words) computes the next of s1-s4 from the numbers a-e drawn for
# the question and the steps before it, and is said "{words} {left} {op} {right} = <<...>>{value}.". legs1/legs2 are
# the legs of the animals named {ap1}/{ap2}: the model must know them (pretraining teaches every animal's legs).
PROBLEMS = [
    ("{name} has {a} {items}. {Pron} buys {b} bags with {c} {items} in each. How many {items} does {name} have now?",
     [("b", "*", "c", "The bags hold"), ("a", "+", "s1", "In all {name} has")]),
    (("{name} had {a} {items}. {Pron} gave {b} to {friend} and then bought {c} more. How many {items} does {name} "
     "have now?"), [("a", "-", "b", "After giving some away {pron} has"), ("s1", "+", "c", "Then {pron} has")]),
    (("On Monday {name} picked {a} {items}, and on Tuesday {pron} picked {b} more. {Pron} ate {c} of them. How many "
     "{items} are left?"), [("a", "+", "b", "{Pron} picked"), ("s1", "-", "c", "Left:")]),
    ("{name} sees {a} {ap1} and {b} {ap2} on a farm. How many legs do they have in all?",
     [("a", "*", "legs1", "The {ap1} have"), ("b", "*", "legs2", "The {ap2} have"), ("s1", "+", "s2", "Together:")]),
    ("{a} friends each bring {b} {items} to a party in {cap}. They eat {c} of them. How many {items} are left?",
     [("a", "*", "b", "They bring"), ("s1", "-", "c", "Left:")]),
    (("A shop in {cap} has {a} boxes with {b} {items} in each. It sells {c} {items}. How many {items} does it have "
     "left?"), [("a", "*", "b", "The shop has"), ("s1", "-", "c", "Left:")]),
    (("{name} has {a} bags of {b} {items}, and {friend} has {c} bags of {d} {items}. How many {items} do they have "
     "together?"), [("a", "*", "b", "{name} has"), ("c", "*", "d", "{friend} has"), ("s1", "+", "s2", "Together:")]),
    (("{name} bought {a} {items} in {cap} and {b} in {cap2}, and then gave {c} to {friend}. How many {items} does "
     "{name} have left?"), [("a", "+", "b", "{Pron} bought"), ("s1", "-", "c", "Left:")]),
    ("Each of {a} children has {b} {items}, and {name} has {c} more. How many {items} are there?",
     [("a", "*", "b", "The children have"), ("s1", "+", "c", "With {name}'s:")]),
    (("{name} has {a} {items}. {Pron} buys {b} bags with {c} {items} in each, then gives {d} {items} to {friend}. How "
      "many {items} does {name} have now?"), [("b", "*", "c", "The bags hold"), ("a", "+", "s1", "Then {pron} has"),
                                               ("s2", "-", "d", "After giving some away:")]),
    (("A farm has {a} {ap1}. {b} more {ap1} come, and {c} {ap2} live there too. How many legs do the animals of the "
      "farm have?"), [("a", "+", "b", "There are"), ("s1", "*", "legs1", "The {ap1} have"),
                      ("c", "*", "legs2", "The {ap2} have"), ("s2", "+", "s3", "Together:")]),
    (("{name} picked {a} {items} and {friend} picked {b} times as many. They ate {c}. How many {items} are left?"),
     [("a", "*", "b", "{friend} picked"), ("a", "+", "s1", "Together they picked"), ("s2", "-", "c", "Left:")]),
]
# a sentence about something else, with a number the problem does not need: the model must pick the right numbers
DISTRACTORS = ["{friend} also has {e} {other}.", "There are {e} {other} on the table too.",
               "It is {day}, and {e} {other} are in the basket."]


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(f"demo world: {len(COUNTRIES)} countries, {len(ANIMALS)} animals, {len(THINGS)} things and their colours, "
          f"{len(DAYS)} days, {len(MONTHS)} months, {len(PHRASINGS)} kinds of fact stated in "
          f"{sum(map(len, PHRASINGS.values()))} phrasings")


if __name__ == "__main__":
    main()
