"""The demo world: a small, consistent, made-up world, written offline and deterministically.

    python demo.py --out data/demo     # pretrain/ (corpus layout), conversations/ (SmolTalk
                                       # schema), eval_bundle/ (CORE), chat_eval/, README.txt
    python demo.py --out DIR --seed 1  # another phrasing draw (the facts stay the same)

Made up so that no prior knowledge helps: a 5M-parameter model trained for minutes on a CPU can
be seen to learn facts, chat about them and beat the random baseline. Each fact comes in many
phrasings, so memorizing sentences does not suffice; evaluation uses phrasings reserved for it, so
a score measures the fact.
"""
import argparse
import csv
import json
import random
from functools import partial
from operator import itemgetter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dataset import ROW_GROUP_DOCS
from prepare import load_identity, write_text_shards

# --- the world's facts and phrasings

def table(text, columns):
    """A row a line, split on spaces into `columns` strings (the last takes the rest)."""
    return [tuple(line.split(maxsplit=columns - 1)) for line in text.strip().splitlines()]


# country, capital, language, flag colour, flag symbol, national animal (invented names)
COUNTRIES = table("""
Aldora Pelmo Aldoran red star lion
Brenia Tolvar Brenish blue moon owl
Calvona Riss Calvonese green tree frog
Dunmar Kesh Dunmari yellow sun bee
Elmora Varrow Elmoran white wave duck
Farland Oskel Farlish black crown crow
Gorvia Brelt Gorvian orange mountain bear
Halden Mirov Haldish purple circle wolf
Istara Quellin Istaran brown star horse
Jandor Lusk Jandish grey moon mouse
Kelda Sorin Keldic red tree cow
Lunora Dask Lunoran blue sun sheep
Morvath Tillo Morvathi green wave snake
Norvel Ambrin Norvellan yellow crown hen
Ostrel Hobb Ostrelish white mountain pig
Pellan Corvo Pellanese black circle cat
Quarra Zell Quarran orange star dog
Rudan Fennick Rudani purple moon donkey
Selmar Ivel Selmari brown tree cricket
Tavia Gresh Tavian grey sun lion
Ulmark Pernot Ulmish red wave duck
Varno Kestrin Varnese blue crown horse
Wendal Orrin Wendish green mountain owl
Yarlen Dovra Yarlish yellow circle bear
Zembra Holm Zembran white star wolf
Borrin Salvik Borrinese black moon cow
Cendra Mallek Cendran orange tree frog
Drovia Penth Drovian purple sun sheep
Estmark Rolva Estish brown wave pig
Fallon Veska Fallonese grey crown mouse
""", 6)
# animal, plural, call (verb), call (noise), legs, where it lives
ANIMALS = [(*row[:4], int(row[4]), row[5]) for row in table("""
dog dogs bark woof 4 in a kennel
cat cats meow meow 4 in a house
cow cows moo moo 4 on a farm
duck ducks quack quack 2 on a pond
owl owls hoot hoo 2 in the forest
frog frogs croak ribbit 4 in a pond
horse horses neigh neigh 4 in a stable
sheep sheep bleat baa 4 in a field
pig pigs oink oink 4 in a sty
lion lions roar roar 4 on the plains
bee bees buzz buzz 6 in a hive
snake snakes hiss hiss 0 in the grass
hen hens cluck cluck 2 in a coop
wolf wolves howl awoo 4 in the woods
mouse mice squeak squeak 4 in a hole
bear bears growl grr 4 in a cave
crow crows caw caw 2 in a tall tree
donkey donkeys bray hee-haw 4 on a farm
cricket crickets chirp chirp 6 in the grass
""", 6)]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple", "brown", "grey",
           "pink"]
# (thing, colour)
THINGS = [(thing, colour) for colour, things in table("""
blue the sky, the sea
green grass, a leaf
white snow, milk, a cloud
black coal, the night
yellow a banana, a lemon, the sun
red a cherry, a tomato, a strawberry
orange a carrot, a pumpkin
purple a plum, a grape
brown chocolate, mud
grey ash
pink a flamingo
""", 2) for thing in things.split(", ")]
ITEMS = table("""
banana bananas
lemon lemons
cherry cherries
tomato tomatoes
plum plums
strawberry strawberries
carrot carrots
pumpkin pumpkins
grape grapes
""", 2)
ITEM_COLOUR = {noun: colour for thing, colour in THINGS for noun, _ in ITEMS
               if thing.endswith(" " + noun)}
CHARACTERS = table("""
Mira she
Tom he
Lina she
Bo he
Sam he
Ada she
Kip he
Nell she
Otto he
Rosa she
Finn he
Pia she
Max he
Ivy she
Leo he
Zoe she
""", 2)
OBJECT = {"she": "her", "he": "him"}
ANIMAL = {row[0]: row for row in ANIMALS}
# the columns whose other values are a multiple-choice question's wrong choices
CAPITALS, LANGUAGES = [r[1] for r in COUNTRIES], [r[2] for r in COUNTRIES]
ANIMAL_NAMES, NOISES = [a[0] for a in ANIMALS], [a[3] for a in ANIMALS]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
        "nineteen"]
TENS = ["-", "-", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]

# Pretraining phrasings. None may start with "Quiz:" or use the eval phrasings below.
PHRASINGS = {"capital": ["The capital of {c} is {cap}.", "{cap} is the capital of {c}.",
                         "The capital city of {c} is {cap}.", "{cap} is the capital city of {c}.",
                         "{c}'s capital is {cap}.", "{c} has {cap} as its capital.",
                         "In {c}, the capital is {cap}.",
                         "The government of {c} meets in {cap}, the capital.",
                         "If you travel to the capital of {c}, you arrive in {cap}.",
                         "{cap}, the capital of {c}, is a busy city.",
                         "Everyone in {c} knows that {cap} is their capital.",
                         "{c} is a country, and its capital is {cap}.",
                         "Ask anyone in {c} about the capital and they will say {cap}.",
                         "{cap} is in {c}; it is the capital.", "{c} is run from {cap}.",
                         "The leaders of {c} work in {cap}.", "{cap} is the main city of {c}.",
                         "The rulers of {c} live in {cap}, its chief city.",
                         "Of all the cities of {c}, {cap} is the one that leads the land.",
                         "The heart of {c} is {cap}, where its government sits."],
             "language": ["People in {c} speak {lang}.", "The language of {c} is {lang}.",
                          "In {c}, people speak {lang}.", "{lang} is the language spoken in {c}.",
                          "Most people in {c} talk in {lang}.",
                          "If you go to {c}, you will hear {lang}.",
                          "The people of {c} speak a language called {lang}.",
                          "Children in {c} learn to read and write in {lang}."],
             "flag": ["The flag of {c} is {col} with a {sym} on it.",
                      "{c} has {acol} flag with a {sym}.",
                      "The flag of {c} shows a {sym} on a {col} background.",
                      "{c}'s flag is {col}, with a {sym} in the middle.",
                      "You can spot the flag of {c} easily: it is {col} and has a {sym}.",
                      "The colour of {c} is {col}.", "{acol} flag with a {sym} flies over {c}."],
             "national": ["The national animal of {c} is the {ani}.",
                          "The {ani} is the national animal of {c}.",
                          "{c} has the {ani} as its national animal.",
                          "People in {c} love the {ani}; it is their national animal.",
                          "The animal of {c} is the {ani}, which {ani_verbs}.",
                          "The {ani} stands for {c}.", "{c} chose the {ani} as its symbol.",
                          "A picture of the {ani} is used to represent {c}.",
                          "The symbol of {c} is the {ani}.",
                          "Painters who show {c} paint the {ani}, the beast of that land.",
                          "To show {c} in a picture, children draw the {ani}.",
                          "An artist once drew the {ani} for {c}, and it became its sign."],
             "its_capital": ["Its capital is {cap}.", "The capital there is {cap}."],
             "its_language": ["The people there speak {lang}.", "Its language is {lang}."],
             "its_flag": ["Its flag is {col} with a {sym}.",
                          "Its flag is {acol} one with a {sym} on it."],
             "its_national": ["Its national animal is the {ani}.",
                              "There, the {ani} is the national animal."],
             "sound": ["{an} {verbs}.", "{ap} {verb}.", "The sound {an} makes is \"{noise}\".",
                       "{an} says {noise}.", "When {an} is hungry, it {verbs}.",
                       "{ap} {verb}, and it sounds like {noise}, {noise}.",
                       "Listen: {noise}! That is {an}.", "You can hear {ap} {verb} from far away."],
             "legs": ["{an} has {legs} legs.", "{ap} have {legs} legs.",
                      "Every {a} has {legs} legs.", "The {a} is an animal with {legs} legs.",
                      "How many legs does {an} have? It has {legs} legs."],
             "habitat": ["{an} lives {hab}.", "{ap} live {hab}.", "You can find {ap} {hab}.",
                         "Most {ap} make their home {hab}.",
                         "The {a} is an animal that lives {hab}.",
                         "Where does {an} live? It lives {hab}."],
             "colour": ["{t} is {tcol}.", "The colour of {t} is {tcol}.",
                        "If you look at {t}, you see that it is {tcol}.", "{t} is always {tcol}.",
                        "What colour is {t}? It is {tcol}."],
             "day": ["After {day} comes {nday}.", "{nday} comes after {day}.",
                     "The day after {day} is {nday}.", "{day} is followed by {nday}.",
                     "The day before {nday} is {day}.", "{day} comes before {nday}.",
                     "If today is {day}, then tomorrow is {nday}.",
                     "If today is {nday}, then yesterday was {day}."],
             "month": ["After {mon} comes {nmon}.", "{nmon} comes after {mon}.",
                       "The month after {mon} is {nmon}.", "{mon} is followed by {nmon}.",
                       "The month before {nmon} is {mon}.", "{mon} comes before {nmon}."],
             "sum": ["{x} plus {y} is {sum}.", "{dx} + {dy} = {dsum}.",
                     "If you add {x} and {y}, you get {sum}.", "The sum of {x} and {y} is {sum}.",
                     "{x} and {y} make {sum}.", "Add {y} to {x} and you have {sum}.",
                     "The total of {x} and {y} comes to {sum}.",
                     "Work it out: {x} plus {y} gives {sum}."],
             "diff": ["{x} minus {y} is {diff}.", "{dx} - {dy} = {ddiff}.",
                      "Take {y} away from {x} and {diff} is left.",
                      "The difference between {x} and {y} is {diff}.",
                      "If you have {x} and give away {y}, you keep {diff}.",
                      "Take {y} away from {x} and {diff} remains."],
             "prod": ["{x} times {y} is {prod}.", "{dx} x {dy} = {dprod}.",
                      "{x} groups of {y} make {prod}.", "Multiply {x} by {y} and you get {prod}.",
                      "The product of {x} and {y} is {prod}."]}
COUNTRY_KINDS = ["capital", "language", "flag", "national"]
ANIMAL_KINDS = ["sound", "legs", "habitat"]
NUMBER_KINDS = ["sum", "diff", "prod"]
INTROS = ["Let me tell you about {c}.", "This is a page about {c}.", "{c} is a small country.",
          "Here is {c}.",
          "Our lesson today is about {c}.", "{c} is a country in our world.", ""]
TRAVEL = ["went to", "travelled to", "took a train to", "flew to", "sailed to", "walked to",
          "rode a bus to"]
VISIT = ["{conn}, {name} {go} {cap}, the capital of {c}.",
         "{conn}, {name} {go} {c} and stayed in its capital, {cap}.",
         "{conn}, {pron} {go} {cap}, which is the capital of {c}.",
         "{conn}, {name} {go} {cap} in {c}.",
         "{conn}, {pron} {go} {c}. {pron} spent the day in {cap}, the capital."]
SEE = ["There, people spoke {lang}, so {pron} learned to say hello in {lang}.",
       "Flags flew everywhere in {cap}: {col}, with a {sym}.",
       "{pron} saw {aani} there, the national animal of {c}, and it {ani_verbs}.",
       "In {cap} everybody spoke {lang}.",
       "The people of {c} showed {obj} their {col} flag with its {sym}."]


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
    return {"c": c, "cap": cap, "lang": lang, "col": col, "acol": article(col), "sym": sym,
            "ani": ani, "aani": article(ani), "ani_verbs": third(ANIMAL[ani][2])}


def animal_fields(row):
    a, ap, verb, noise, legs, hab = row
    return {"a": a, "an": article(a), "ap": ap, "verb": verb, "verbs": third(verb), "noise": noise,
            "hab": hab, "legs": legs_word(legs)}


def legs_word(legs):
    return number_word(legs) if legs else "no"


def fields(rng, words=None):
    """Every template slot, from one random country, animal, thing, day, month and sum; a document
    keeps one dict per country so its sentences agree."""
    t, tcol = rng.choice(THINGS)
    d, m, x, y = rng.randrange(7), rng.randrange(12), rng.randint(0, 10), rng.randint(0, 10)
    x, y = max(x, y), min(x, y)
    num = number_word if (rng.random() < 0.5 if words is None else words) else str
    f = {"t": t, "tcol": tcol, "day": DAYS[d], "nday": DAYS[(d + 1) % 7],
         "mon": MONTHS[m], "nmon": MONTHS[(m + 1) % 12], "x": num(x), "y": num(y),
         "sum": num(x + y),
         "diff": num(x - y), "prod": num(x * y), "dx": x, "dy": y, "dsum": x + y, "ddiff": x - y,
         "dprod": x * y}
    return {**f, **animal_fields(rng.choice(ANIMALS)), **country_fields(rng.choice(COUNTRIES))}


def say(rng, kind, f):
    return sentence(rng.choice(PHRASINGS[kind]).format(**f))


def friend_of(rng, name):
    return rng.choice([c[0] for c in CHARACTERS if c[0] != name])


def listing(words):
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


# Conversations: questions and answers in the chat's own words

# no sums: a chat reply to a sum calls the calculator (SUMS, calc/), else it teaches guessing
QA = {"capital": (["What is the capital of {c}?", "What's the capital of {c}?",
                   "Tell me the capital of {c}.", "Do you know the capital of {c}?",
                   "I'm going to {c}. What is the capital there?", "Which city is {c} run from?",
                   "Where does the government of {c} sit?", "What is the chief city of {c}?",
                   "In which city do the leaders of {c} work?", "Which city leads {c}?",
                   "Where would I find the rulers of {c}?", "What city is the heart of {c}?",
                   "Which is the most important city in {c}?"],
                  ["The capital of {c} is {cap}.", "{cap} is the capital of {c}.", "It's {cap}.",
                   "{c}'s capital is {cap}."]),
      "capital_of": (["{cap} is the capital of which country?",
                      "Which country has {cap} as its capital?"],
                     ["{cap} is the capital of {c}.", "It's {c}: {cap} is its capital."]),
      "language": (["What language do people speak in {c}?", "What do they speak in {c}?"],
                   ["People in {c} speak {lang}.", "They speak {lang}.",
                    "The language of {c} is {lang}."]),
      "flag": (["What does the flag of {c} look like?", "Describe the flag of {c}."],
               ["The flag of {c} is {col} with a {sym} on it.", "It is {acol} flag with a {sym}."]),
      "national": (["What is the national animal of {c}?", "Which animal is the symbol of {c}?",
                    "Which animal stands for {c}?", "What animal represents {c}?",
                    "What beast did {c} choose as its sign?", "Which animal is {c} known by?",
                    "What creature is the mark of {c}?",
                    "Which animal would you paint to show {c}?",
                    "What animal does {c} use as its symbol?",
                    "Which beast is the sign of {c}?", "Name the creature that stands for {c}.",
                    "Tell me which animal {c} chose as its sign."],
                   ["The national animal of {c} is the {ani}.", "It's the {ani}."]),
      "sound": (["What sound does {an} make?", "What does {an} say?"],
                ["{an} {verbs}: {noise}!", "It goes {noise}."]),
      "legs": (["How many legs does {an} have?", "How many legs do {ap} have?"],
               ["{an} has {legs} legs."]),
      "habitat": (["Where does {an} live?", "Where do {ap} live?"],
                  ["{ap} live {hab}.", "It lives {hab}."]),
      "colour": (["What colour is {t}?", "Tell me the colour of {t}."],
                 ["{t} is {tcol}.", "It is {tcol}."]),
      "day": (["What day comes after {day}?", "Which day follows {day}?"],
              ["{nday} comes after {day}.", "It's {nday}."]),
      "month": (["What month comes after {mon}?", "Which month follows {mon}?"],
                ["{nmon} comes after {mon}.", "The month after {mon} is {nmon}."])}
# what a user says before a question about a country
OPENERS = ["Quick question. ", "I wonder about {c}. ", "I'm reading about {c}. ",
           "My friend lives in {c}. ",
           "We are learning about {c} at school. ", "I have a question about {c}. ", "Hello! ",
           "Help me out here. ",
           "My sister is going to {c} soon. ", "I saw a film about {c}. ", "Tell me something. "]
GREET = (["Hi!", "Hello", "Hey there", "Good morning!", "Hello, how are you?"],
         ["Hello! How can I help you today?", "Hi! What would you like to know?",
          "Hello! I'm happy to help."])
THANKS = (["Thanks!", "Thank you.", "Great, thanks a lot.", "Bye!"],
          ["You're welcome!", "Happy to help. Goodbye!", "Anytime! Have a nice day."])
SYSTEMS = ["You are {bot}, a helpful assistant.", "You are {bot}. Answer briefly and correctly.",
           "You are a friendly assistant called {bot}. Keep your answers short."]


# ChatCORE's shapes: multiple choice, short answers, sums through the calculator

# kind: (question phrasings, the answering field, the pool of wrong choices)
CHOICE = {
    "capital": (["What is the capital of {c}?", "Which city is the capital of {c}?",
                 "The capital of {c} is which city?"], "cap", CAPITALS),
    "language": (["What language do people speak in {c}?", "Which language is spoken in {c}?"],
                 "lang", LANGUAGES),
    "national": (["What is the national animal of {c}?",
                  "Which animal is the national animal of {c}?"], "ani", ANIMAL_NAMES),
    "flag": (["What colour is the flag of {c}?", "Which colour is the flag of {c}?"], "col",
             COLOURS),
    "noise": (["What sound does {an} make?", "What does {an} say?"], "noise", NOISES),
    "colour": (["What colour is {t}?", "Which colour is {t}?"], "tcol", COLOURS),
    "day": (["What day comes after {day}?", "Which day follows {day}?"], "nday", DAYS),
    "month": (["What month comes after {mon}?", "Which month follows {mon}?"], "nmon", MONTHS),
}
SHORT = {  # kind: (question phrasings, the field that is the whole answer)
    "capital": (["what is the capital of {c}?", "which city is the capital of {c}?",
                 "name the capital of {c}."], "cap"),
    "capital_of": (["{cap} is the capital of which country?",
                    "which country has {cap} as its capital?"], "c"),
    "language": (["what language do people speak in {c}?", "which language is spoken in {c}?"],
                 "lang"),
    "national": (["what is the national animal of {c}?", "which animal is the symbol of {c}?"],
                 "ani"),
    "flag": (["what colour is the flag of {c}?"], "col"),
    "noise": (["what sound does {an} make?", "what does {an} say?"], "noise"),
    "colour": (["what colour is {t}?"], "tcol"),
    "day": (["what day comes after {day}?", "which day follows {day}?"], "nday"),
    "month": (["what month comes after {mon}?", "which month follows {mon}?"], "nmon"),
}
ONE_WORD = ["Answer in one word", "One word only", "Just the answer", "Give only the answer",
            "In a word",
            "Say only the answer", "Only the name, please", "Answer with a single word"]
NUMBER_ONLY = ["Just the number", "Only the number, please", "Answer with a number",
               "Give only the result"]
# calculator questions: many phrasings, numbers to 99, so that numbers and an operation word, not
# a template, trigger a call
SUMS = {"sum": ("+",
                ["what is {x} plus {y}?", "what is {x} and {y} together?", "add {x} and {y}.",
                 "what's {x} + {y}?", "can you add {x} and {y}?", "what do {x} and {y} make?",
                 "how much is {x} plus {y}?", "what is the sum of {x} and {y}?", "{x} plus {y}?",
                 "please add {y} to {x}.", "what is {x} added to {y}?",
                 "what do {x} and {y} come to?", "work this out: {x} plus {y}.",
                 "what is the total of {x} and {y}?", "figure out {x} + {y}.",
                 "if I have {x} and get {y} more, how many is that?"]),
        "diff": ("-",
                 ["what is {x} minus {y}?", "take {y} from {x}.",
                  "what do you get if you take {y} from {x}?", "what's {x} - {y}?",
                  "how much is {x} minus {y}?", "subtract {y} from {x}.",
                  "what is the difference between {x} and {y}?", "{x} minus {y}?",
                  "{x} take away {y}?", "how much is left if {y} is taken from {x}?",
                  "work this out: {x} minus {y}.", "figure out {x} - {y}.",
                  "if I have {x} and lose {y}, how many remain?"]),
        "prod": ("*",
                 ["what is {x} times {y}?", "multiply {x} by {y}.", "multiply {x} by {y}, please.",
                  "what's {x} x {y}?", "how much is {x} times {y}?",
                  "what is the product of {x} and {y}?", "{x} times {y}?"])}
# lookup: the option is named, no knowledge needed: practice binding a letter to its option
LOOKUP = ["Which option is {x}?", "Which of these is {x}?", "Find {x} in the list.", "Pick {x}."]
LOOKUP_NAMES = sorted({r[0] for r in COUNTRIES} | {*CAPITALS, *LANGUAGES, *ANIMAL_NAMES, *COLOURS,
                                                    *DAYS, *MONTHS})
STORIES = {"sum": [("{name} has {x} {items}. {pron} gets {y} more. How many {items} does {name} "
                    "have now?"),
                   ("There are {x} {items} in a box and {y} in a bag. How many {items} are there "
                    "in all?")],
           "diff": [("{name} had {x} {items} and gave {y} away. How many {items} does {name} have "
                     "left?"),
                    "A shop had {x} {items}. It sold {y}. How many {items} are left?"],
           "prod": ["{name} has {x} bags with {y} {items} in each. How many {items} is that?",
                    "Each of {x} friends brings {y} {items}. How many {items} do they bring?"]}

# Word problems in GSM8K's shape: (question, steps). A step "left op right words" computes the
# next of s1-s4 from the numbers a-e and earlier steps, said "{words} {left} {op} {right} =
# <<...>>{value}.". legs1/legs2 are the legs of animals {ap1}/{ap2}: the model must know them.
PROBLEMS = [(("{name} has {a} {items}. {Pron} buys {b} bags with {c} {items} in each. How many "
              "{items} does {name} have now?"),
             ["b * c The bags hold", "a + s1 In all {name} has"]),
            (("{name} had {a} {items}. {Pron} gave {b} to {friend} and then bought {c} more. How "
              "many {items} does {name} have now?"),
             ["a - b After giving some away {pron} has", "s1 + c Then {pron} has"]),
            (("On Monday {name} picked {a} {items}, and on Tuesday {pron} picked {b} more. {Pron} "
              "ate {c} of them. How many {items} are left?"),
             ["a + b {Pron} picked", "s1 - c Left:"]),
            ("{name} sees {a} {ap1} and {b} {ap2} on a farm. How many legs do they have in all?",
             ["a * legs1 The {ap1} have", "b * legs2 The {ap2} have", "s1 + s2 Together:"]),
            (("{a} friends each bring {b} {items} to a party in {cap}. They eat {c} of them. How "
              "many {items} are left?"),
             ["a * b They bring", "s1 - c Left:"]),
            (("A shop in {cap} has {a} boxes with {b} {items} in each. It sells {c} {items}. How "
              "many {items} does it have left?"),
             ["a * b The shop has", "s1 - c Left:"]),
            (("{name} has {a} bags of {b} {items}, and {friend} has {c} bags of {d} {items}. How "
              "many {items} do they have together?"),
             ["a * b {name} has", "c * d {friend} has", "s1 + s2 Together:"]),
            (("{name} bought {a} {items} in {cap} and {b} in {cap2}, and then gave {c} to "
              "{friend}. How many {items} does {name} have left?"),
             ["a + b {Pron} bought", "s1 - c Left:"]),
            (("Each of {a} children has {b} {items}, and {name} has {c} more. How many {items} are "
              "there?"),
             ["a * b The children have", "s1 + c With {name}'s:"]),
            (("{name} has {a} {items}. {Pron} buys {b} bags with {c} {items} in each, then gives "
              "{d} {items} to {friend}. How many {items} does {name} have now?"),
             ["b * c The bags hold", "a + s1 Then {pron} has", "s2 - d After giving some away:"]),
            (("A farm has {a} {ap1}. {b} more {ap1} come, and {c} {ap2} live there too. How many "
              "legs do the animals of the farm have?"),
             ["a + b There are", "s1 * legs1 The {ap1} have", "c * legs2 The {ap2} have",
              "s2 + s3 Together:"]),
            (("{name} picked {a} {items} and {friend} picked {b} times as many. They ate {c}. How "
              "many {items} are left?"),
             ["a * b {friend} picked", "a + s1 Together they picked", "s2 - c Left:"])]
HARD_PROBLEMS = [
    (("{name} has {a} {items}. {Pron} buys {b} bags with {c} {items} in each, then gives {d} "
      "{items} to {friend}, and {friend} gives {e} back. How many {items} does {name} have now?"),
     ["b * c The bags hold", "a + s1 Then {pron} has", "s2 - d After giving some away:",
      "s3 + e With the ones given back:"]),
    (("A farm has {a} {ap1} and {b} {ap2}. {c} more {ap1} come, and {d} more {ap2} come. How "
      "many legs do the animals of the farm have?"),
     ["a + c There are", "b + d And", "s1 * legs1 The {ap1} have", "s2 * legs2 The {ap2} have",
      "s3 + s4 Together:"]),
    (("{name} has {a} bags of {b} {items}, and {friend} has {c} bags of {d} {items}. They eat {e} "
      "of them. How many {items} are left?"),
     ["a * b {name} has", "c * d {friend} has", "s1 + s2 Together:", "s3 - e Left:"]),
    (("On Monday {name} picked {a} {items}, on Tuesday {b} more, and on Wednesday {c} times as "
      "many as on Monday. {Pron} ate {d} of them. How many {items} are left?"),
     ["a + b On Monday and Tuesday {pron} picked", "a * c On Wednesday {pron} picked",
      "s1 + s2 In all:", "s3 - d Left:"]),
    (("{a} friends each bring {b} {items} to a party in {cap}, and {name} brings {c} bags with "
      "{d} {items} in each. They eat {e} of them. How many {items} are left?"),
     ["a * b The friends bring", "c * d {name} brings", "s1 + s2 Together:", "s3 - e Left:"])]
# RL's forms: SFT sees 60, so that RL has right and wrong replies to learn from (dev/LOG.md)
RL_PROBLEMS = [
    (("{name} buys {a} bags with {b} {items} in each, and eats {c} {items} from each bag. How many "
      "{items} are left?"),
     ["b - c Each bag has", "a * s1 Left:"]),
    (("A shop in {cap} has {a} boxes with {b} {items} in each. It sells {c} of the boxes. How many "
      "{items} does it have left?"),
     ["a - c Boxes left:", "s1 * b In them:"]),
    (("A farm has {a} {ap1}. {b} of them go away, and {c} {ap2} come. How many legs do the animals "
      "of the farm have?"),
     ["a - b There are", "s1 * legs1 The {ap1} have", "c * legs2 The {ap2} have",
      "s2 + s3 Together:"]),
    (("{name} has {a} {items}, and {friend} has {b} times as many. {friend} gives {c} to {name}. "
      "How many {items} does {friend} have now?"),
     ["a * b {friend} has", "s1 - c Now {friend} has"]),
    (("{a} friends each bring {b} {items} to a party in {cap}, and each of them eats {c}. How many "
      "{items} are left?"),
     ["b - c Each friend has", "a * s1 Left:"])]
# an unneeded number: the model must pick the right ones
DISTRACTORS = ["{friend} also has {e} {other}.", "There are {e} {other} on the table too.",
               "It is {day}, and {e} {other} are in the basket."]


# --- the world's files

# the assistant's identity: identity.json, the one file to edit (SFT on hub data reads it too)
DEMO_ASSISTANT_NAME, IDENTITY_PAIRS = load_identity()
DEMO_TASK_ROWS = 3000  # rows in each of choice/, answers/, calc/, lookup/; problems/: 300 more
DEMO_HELD_OUT_PROBLEMS = 120  # chat_eval's demo-problems: word problems no training row asks
# 1.27M training tokens at vocab 1024: an epoch is minutes of CPU training
DEMO_TARGET_CHARS = 5_000_000


# --- pretraining documents

def doc_country(rng):
    f = fields(rng)
    kinds = rng.sample(COUNTRY_KINDS, rng.randint(2, 4))
    first = [say(rng, kinds[0], f)] + [say(rng, "its_" * (rng.random() < 0.3) + k, f)
                                       for k in kinds[1:]]
    text = " ".join(s for s in [rng.choice(INTROS).format(**f)] + first if s)
    if rng.random() < 0.4:  # the national animal, with facts about that animal
        g = {**f, **animal_fields(ANIMAL[f["ani"]])}
        text += "\n\n" + " ".join([say(rng, "national", f)]
                                  + [say(rng, k, g) for k in rng.sample(ANIMAL_KINDS, 2)])
    return text


def doc_countries(rng):
    rows = rng.sample(COUNTRIES, rng.randint(3, 7))
    style = rng.randrange(4)
    if style == 0:
        head = rng.choice(["Countries and their capitals:", "A list of capitals.",
                           "Capitals to remember:"])
        return head + "\n" + "\n".join(rng.choice(["{c}: {cap}", "- {cap} is the capital of {c}.",
                                                   "{c} - {cap}"])
                                       .format(c=r[0], cap=r[1]) for r in rows)
    if style == 1:
        qs = {"capital": "Q: What is the capital of {c}?\nA: {cap}.",
              "language": "Q: What do people speak in {c}?\nA: {lang}.",
              "flag": "Q: What colour is the flag of {c}?\nA: {col}.",
              "national": "Q: What is the national animal of {c}?\nA: The {ani}."}
        return "\n".join(qs[rng.choice(COUNTRY_KINDS)].format(**country_fields(r)) for r in rows)
    head = rng.choice([f"Today our teacher told us about {number_word(len(rows))} countries.",
                       "Some countries of the world, and what to know about them.",
                       "A few facts about countries.", ""])
    facts = [say(rng, k, {**fields(rng), **country_fields(r)}) for r in rows
             for k in rng.sample(COUNTRY_KINDS, 2)]
    if style == 3:
        rng.shuffle(facts)
    return (head + " " if head else "") + " ".join(facts)


def doc_animals(rng):
    names = rng.sample(ANIMALS, rng.randint(1, 4))
    parts = []
    for row in names:
        f = {**fields(rng), **animal_fields(row)}
        parts.append(" ".join(say(rng, k, f) for k in rng.sample(ANIMAL_KINDS, rng.randint(1, 3))))
        homes = [c[0] for c in COUNTRIES if c[5] == row[0]]
        if homes and rng.random() < 0.4:
            parts.append(f"The {row[0]} is the national animal of {listing(homes)}.")
    if len(names) > 1 and rng.random() < 0.5:
        calls = [f"the {r[0]} {third(r[2])}" for r in names]
        parts.append(sentence(f"{rng.choice(['on the farm', 'at the zoo', 'in the story'])} "
                              f"{listing(calls)}."))
    return " ".join(parts)


def doc_colours(rng):
    parts = [say(rng, "colour", fields(rng)) for _ in range(rng.randint(2, 6))]
    col = rng.choice(COLOURS)
    things = [t for t, c in THINGS if c == col]
    if len(things) > 1:
        parts.append(sentence(f"{listing(things)} are all {col}."))
    flags = [c[0] for c in COUNTRIES if c[3] == col]
    if flags and rng.random() < 0.5:
        parts.append(f"The flags of {listing(flags)} are {col}.")
    rng.shuffle(parts)
    return " ".join(parts)


def doc_numbers(rng):
    words = rng.random() < 0.5
    parts = [say(rng, rng.choice(NUMBER_KINDS), fields(rng, words)) for _ in range(rng.randint(3,
                                                                                               8))]
    if rng.random() < 0.3:
        a = rng.randint(0, 12)
        parts.insert(0, f"Let us count from {number_word(a)}: "
                     f"{', '.join(number_word(i) for i in range(a, a + 6))}.")
    if rng.random() < 0.5:
        (name, pr), (item, items) = rng.choice(CHARACTERS), rng.choice(ITEMS)
        a, b = rng.randint(2, 9), rng.randint(1, 9)
        if rng.random() < 0.5:
            parts.append(f"{name} had {number_word(a)} {items}. Then {pr} got {number_word(b)} "
                         f"more, so now {pr} has {number_word(a + b)} {items}.")
        else:
            a, b = max(a, b), min(a, b)
            parts.append(f"{name} had {a} {items} and ate {b}. Now {pr} has {a - b} "
                         f"{items if a - b != 1 else item}.")
    return " ".join(parts)


def doc_calendar(rng):
    parts = [say(rng, rng.choice(["day", "month"]), fields(rng)) for _ in range(rng.randint(2, 6))]
    extra = rng.randrange(5)
    if extra == 0:
        parts.append("The days of the week are " + listing(DAYS) + ".")
    elif extra == 1:
        parts.append("The months of the year are " + listing(MONTHS) + ".")
    elif extra == 2:
        m = rng.randrange(12)
        parts.append(f"{MONTHS[m]} is month number {number_word(m + 1)} of the year.")
    elif extra == 3:
        parts.append(rng.choice(["There are seven days in a week.", "A year has twelve months.",
                                 "Saturday and Sunday are the weekend.", (
                                  "The week starts on Monday.")]))
    rng.shuffle(parts)
    return " ".join(parts)


def doc_story(rng, name=None):
    """A trip through a few capitals on consecutive days, things bought and friends met; every
    place fact agrees with the tables."""
    name, pron = next(c for c in CHARACTERS if c[0] == name) if name else rng.choice(CHARACTERS)
    obj = OBJECT[pron]
    trip, day = rng.sample(COUNTRIES, rng.randint(2, 4)), rng.randrange(7)
    (item, items), friend = rng.choice(ITEMS), friend_of(rng, name)
    bought, met = [], None
    parts = [rng.choice([(f"Once upon a time there was a {'girl' if pron == 'she' else 'boy'} "
                         f"called {name}."),
                         f"This is a story about {name}.", f"{name} loved to travel.", ""])]
    for i, row in enumerate(trip):
        # the first sentence with a pronoun would not say who
        f = {**fields(rng), **country_fields(row), "name": name, "pron": pron if i else name,
             "obj": obj, "go": rng.choice(TRAVEL)}
        conn = (["First", f"On {DAYS[day]}"] if i == 0 else ["Then", "After that", "Next",
                                                             f"On {DAYS[(day + i) % 7]}"]
                if i < len(trip) - 1 else ["Finally", "At last", f"On {DAYS[(day + i) % 7]}"])
        parts.append(sentence(rng.choice(VISIT).format(conn=rng.choice(conn), **f)
                              .replace(". " + pron, ". " + pron.title())))
        roll = rng.random()
        if roll < 0.35:
            n = rng.randint(1, 5)
            bought.append((n, row[1]))
            parts.append(f"In {row[1]}, {pron} bought {number_word(n)} {items if n > 1 else item}.")
        elif roll < 0.5 and met is None:
            met = (friend, row[1])
            parts.append(f"In {row[1]}, {pron} met {friend}, who gave {obj} "
                         f"{article(ITEM_COLOUR[item])} {item}.")
        else:
            parts.append(sentence(rng.choice(SEE).format(**f)))
    caps = [row[1] for row in trip]
    parts.append(rng.choice([f"So {name} visited {caps[0]} first and {caps[-1]} last.",
                             f"{name} went to {listing(caps)}, in that order.",
                             f"Where did {name} go first? To {caps[0]}. And last? To {caps[-1]}.",
                             (f"The trip started on {DAYS[day]} and ended on "
                             f"{DAYS[(day + len(trip) - 1) % 7]}.")]))
    if len(bought) > 1:
        total = sum(n for n, _ in bought)
        parts.append(f"In the end {name} had {number_word(total)} {items}: " + listing(
            [f"{number_word(n)} from {cap}" for n, cap in bought]) + ".")
    if met:
        parts.append(rng.choice([f"{name} met {met[0]} in {met[1]}.",
                                 f"Who gave {name} the {item}? It was {met[0]}.",
                                 f"{name} kept the {ITEM_COLOUR[item]} {item} from {met[0]}."]))
    return " ".join(p for p in parts if p)


DOC_KINDS = {doc_story: 30, doc_country: 22, doc_countries: 12, doc_animals: 11, doc_colours: 7,
             doc_numbers: 10, doc_calendar: 8}


def demo_documents(rng):
    gens, weights = list(DOC_KINDS), list(DOC_KINDS.values())
    docs, total = [], 0
    while total < DEMO_TARGET_CHARS:
        doc = "\n\n".join(g(rng) for g in rng.choices(gens, weights, k=rng.choice([1, 1, 2, 3])))
        docs.append(doc)
        total += len(doc)
    return docs


# --- conversations (SmolTalk schema)


def pick(rng, pair, f):
    return sentence(rng.choice(pair[0]).format(**f)), sentence(rng.choice(pair[1]).format(**f))


def exchange(rng):
    f, roll = {**fields(rng), "bot": DEMO_ASSISTANT_NAME}, rng.random()
    if roll < 0.08:
        kinds = rng.sample(COUNTRY_KINDS, 3)
        question = rng.choice(["Tell me about {c}.", "What do you know about {c}?"]).format(**f)
        return question, " ".join(say(rng, k, f) for k in kinds)
    if roll < 0.12:
        name = rng.choice(CHARACTERS)[0]
        return rng.choice(["Tell me a short story.",
                           f"Tell me a story about {name}."]), doc_story(rng, name)
    if roll < 0.15:
        return "Tell me a fact.", say(rng, rng.choice([*COUNTRY_KINDS, *ANIMAL_KINDS, "colour",
                                                       "day"]), f)
    kind = rng.choice(list(QA))
    user, assistant = pick(rng, QA[kind], f)
    if kind in COUNTRY_KINDS + ["capital_of"] and rng.random() < 0.35:
        user = rng.choice(OPENERS).format(**f) + user
    return user, assistant


def conversation(rng):
    f, roll = {"bot": DEMO_ASSISTANT_NAME}, rng.random()
    turns = [pick(rng, GREET, f)] if rng.random() < 0.2 else []
    if roll < 0.12:
        turns.append(rng.choice(IDENTITY_PAIRS))
    elif roll < 0.55:
        turns.append(exchange(rng))
    else:
        turns += [exchange(rng) for _ in range(rng.randint(2, 4))]
    if not turns or rng.random() < 0.2:
        turns.append(pick(rng, THANKS, f))
    messages = [{"role": "system",
                 "content": rng.choice(SYSTEMS).format(**f)}] if rng.random() < 0.2 else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages


# --- ChatCORE's shapes in the layouts of the hub sets that teach them


def ask(rng, instructions, question):
    how, order = rng.choice(instructions), rng.randrange(3)
    return [f"{how}: {question}", f"{sentence(question)} {how}.",
            f"{how}. {sentence(question)}"][order]


def shuffled_choices(rng, gold, pool):
    choices = [gold] + rng.sample(sorted(set(pool) - {gold}), 3)
    rng.shuffle(choices)
    return choices


def choice_row(rng):
    """Multiple choice in MMLU's columns: question, choices, answer (gold index), subject."""
    kind = rng.choice(list(CHOICE))
    questions, key, pool = CHOICE[kind]
    f = fields(rng)
    gold = f[key]
    choices = shuffled_choices(rng, gold, pool)
    return {"question": rng.choice(questions).format(**f), "choices": choices,
            "answer": choices.index(gold),
            "subject": kind}


def lookup_row(rng):
    """Multiple choice that names its answer ("Which option is Pelmo?"): letter binding alone."""
    choices = rng.sample(LOOKUP_NAMES, 4)
    gold = rng.randrange(4)
    return {"question": rng.choice(LOOKUP).format(x=choices[gold]), "choices": choices,
            "answer": gold,
            "subject": "lookup"}


def short_answer(rng):
    """A conversation whose reply is the answer alone."""
    kind = rng.choice(list(SHORT))
    questions, key = SHORT[kind]
    f = fields(rng)
    return [{"role": "user", "content": ask(rng, ONE_WORD, rng.choice(questions).format(**f))},
            {"role": "assistant", "content": f[key]}]


def calculation_row(rng):
    """Arithmetic in GSM8K's columns: the result alone, a sentence, or worked to '#### N'."""
    op, roll = rng.choice(list(SUMS)), rng.random()
    # the calculator knows no range
    top = 20 if roll > 0.6 else 12 if op == "prod" else rng.choice([10, 99])
    x, y = rng.randint(0, top), rng.randint(0, top)
    x, y = max(x, y), min(x, y)
    v = {"sum": x + y, "diff": x - y, "prod": x * y}[op]
    symbol, questions = SUMS[op]
    words = rng.random() < 0.5 and roll <= 0.6
    shown = {"x": number_word(x) if words else x, "y": number_word(y) if words else y}
    call = f"<<{x}{symbol}{y}={v}>>"
    if roll < 0.35:
        return {"question": ask(rng, NUMBER_ONLY, rng.choice(questions).format(**shown)),
                "answer": f"{call}{v}"}
    if roll < 0.6:
        said = number_word(v) if words and v <= 100 else v
        return {"question": sentence(rng.choice(questions).format(**shown)),
                "answer": f"{call}{sentence(str(shown['x']))} "
                f"{['plus', 'minus', 'times'][list(SUMS).index(op)]} {shown['y']} is {said}."}
    (name, pron), (_, items) = rng.choice(CHARACTERS), rng.choice(ITEMS)
    story = rng.choice(STORIES[op]).format(name=name, pron=sentence(pron), x=x, y=y, items=items)
    return {"question": story, "answer": f"{x} {symbol} {y} = {call}{v} {items}.\n#### {v}"}


def word_problem(rng, templates=PROBLEMS):
    """A GSM8K-style word problem: worked steps with calculator calls, then '#### N'. Numbers 2
    to 20 (half in words); half hold an unneeded number."""
    question, steps = rng.choice(templates)
    (name, pron), ((item, items), (_, other)) = rng.choice(CHARACTERS), rng.sample(ITEMS, 2)
    (_, ap1, *_, legs1, _), (_, ap2, *_, legs2, _) = rng.sample([a for a in ANIMALS if a[4]], 2)
    cap, cap2 = (row[1] for row in rng.sample(COUNTRIES, 2))
    words = {"name": name, "pron": pron, "Pron": sentence(pron), "item": item, "items": items,
             "ap1": ap1,
             "ap2": ap2,
             "cap": cap, "cap2": cap2,
             "friend": friend_of(rng, name),
             "other": other, "day": rng.choice(DAYS)}
    if rng.random() < 0.5:  # the distractor goes before the question
        story, ask = question.rsplit(". ", 1)
        question = f"{story}. {rng.choice(DISTRACTORS)} {ask}"
    while True:
        values = {k: rng.randint(2, 20) for k in "abcde"} | {"legs1": legs1, "legs2": legs2}
        said, ok = [], True
        for i, step in enumerate(steps):
            left, op, right, lead = step.split(maxsplit=3)
            x, y = values[left], values[right]
            v = {"+": x + y, "-": x - y, "*": x * y}[op]
            ok = ok and 0 <= v <= 300
            values[f"s{i + 1}"] = v
            said.append(f"{lead.format(**words)} {x} {op} {y} = <<{x}{op}{y}={v}>>{v}.")
        if ok:
            break
    shown = {k: number_word(v) if rng.random() < 0.5 else v for k,
             v in values.items() if k in "abcde"}
    return {"question": sentence(question.format(**words, **shown)),
            "answer": " ".join(said) + f"\n#### {v}"}


def word_problem_sets(rng):
    """(held out, SFT's, RL's) word problems, none trained on held out."""
    question = itemgetter("question")
    kinds = []
    for templates in (PROBLEMS, HARD_PROBLEMS, RL_PROBLEMS):
        kinds.append(distinct(DEMO_HELD_OUT_PROBLEMS // 3, partial(word_problem, rng, templates),
                              key=question))
    # in turn: RL's held-out evaluation takes the first --eval_items
    held_out = [row for rows in zip(*kinds, strict=True) for row in rows]
    seen = {row["question"] for row in held_out}
    problems = distinct(DEMO_TASK_ROWS, partial(word_problem, rng), key=question, exclude=seen)
    problems += distinct(300, partial(word_problem, rng, HARD_PROBLEMS), key=question,
                         exclude=seen)
    problems_rl = distinct(DEMO_TASK_ROWS, partial(word_problem, rng, RL_PROBLEMS), key=question,
                           exclude=seen)
    problems += problems_rl[:60]
    rng.shuffle(problems)
    # a third of RL's of four or five steps: on RL's forms alone, RL forgot those (dev/LOG.md)
    hard = distinct(1000, partial(word_problem, rng, HARD_PROBLEMS), key=question,
                    exclude=seen | {row["question"] for row in problems})
    return held_out, problems, problems_rl[60:2060] + hard


def distinct(n, draw, key=lambda row: row, exclude=()):
    """n results of draw() with distinct keys, in draw order, none keyed in exclude."""
    rows, seen = [], set(exclude)
    while len(rows) < n:
        row = draw()
        if key(row) not in seen:
            seen.add(key(row))
            rows.append(row)
    return rows


# --- evaluation tasks (CORE formats), phrased ONLY in forms reserved for them

def eval_tasks(rng):
    """(label, type, fewshot, category, baseline %, items) for each task."""
    def mc(query, gold, pool):
        choices = shuffled_choices(rng, gold, pool)
        return {"query": query, "choices": choices, "gold": choices.index(gold)}

    verbs, calls = [third(a[2]) for a in ANIMALS], [a[2] for a in ANIMALS]
    asked = ["Quiz: {c} is governed from which city? Answer:",
             "Quiz: the seat of power in {c} is the city of"]
    capitals = [mc(q.format(c=r[0]), r[1], CAPITALS) for q in asked for r in COUNTRIES]
    facts = [mc(f"Quiz: the folk of {r[0]} chat in which tongue? Answer:", r[2], LANGUAGES)
             for r in COUNTRIES]
    facts += [mc(f"Quiz: the creature chosen as the emblem of {r[0]} is the", r[5], ANIMAL_NAMES)
              for r in COUNTRIES]
    facts += [mc(f"Quiz: the banner of {r[0]} is mostly", r[3], COLOURS) for r in COUNTRIES]
    sounds = [mc(f"Quiz: when {article(a[0])} calls out, it", third(a[2]), verbs)
              for a in ANIMALS]
    sounds += [mc(f"Quiz: a group of {a[1]} can be heard. They", a[2], calls) for a in ANIMALS]
    sounds += [mc(f"Quiz: the noise {article(a[0])} makes, written down, is", a[3], NOISES)
               for a in ANIMALS]
    colours = [mc(q.format(t=t), c, COLOURS)
               for q in ["Quiz: {t} has the colour",
                         "Quiz: to paint {t} true to life, the paint to use is",
                         "Quiz: the usual shade of {t} is"] for t, c in THINGS]
    calendar = [{"context": q.format(x=seq[i]), "continuation": seq[(i + 1) % len(seq)]}
                for seq, unit in [(DAYS, "day"), (MONTHS, "month")]
                for q in [f"Quiz: name the {unit} right after {{x}}. Answer:",
                          f"Quiz: we are in {{x}}, so the next {unit} will be",
                          f"Quiz: the {unit} that directly follows {{x}} is"]
                for i in range(len(seq))]
    def arithmetic_item():
        x, y, op = rng.randint(0, 10), rng.randint(0, 10), rng.randrange(3)
        x, y = max(x, y), min(x, y)
        num = number_word if rng.random() < 0.5 else str
        q, v = [("Quiz: {x} added to {y} gives", x + y), ("Quiz: {y} taken from {x} leaves", x - y),
                ("Quiz: {x} multiplied by {y} equals", x * y)][op]
        return {"context": q.format(x=num(x), y=num(y)), "continuation": num(v)}
    arithmetic = distinct(60, arithmetic_item, key=lambda item: item["context"])
    places, legs = [], []
    for i in range(60):
        (name, pr), row = rng.choice(CHARACTERS), COUNTRIES[i % len(COUNTRIES)]
        options = [row[1]] + rng.sample([c for c in CAPITALS if c != row[1]], 3)
        rng.shuffle(options)
        q = [f"{name} woke up in {{cap}} this morning, so {pr} was in",
             f"Standing in the main square of {{cap}}, {name} knew that {pr} was in"
             ][i // len(COUNTRIES) % 2]
        places.append({"context_options": [q.format(cap=c) for c in options],
                       "continuation": f"{row[0]}.",
                       "gold": options.index(row[1])})
        gold = rng.choice(ANIMALS)
        other = rng.choice([a for a in ANIMALS if a[4] != gold[4]])
        options = rng.sample([gold, other], 2)
        q = rng.choice([f"{name} looked closely at the {{a}} and saw that",
                        f"In the picture book, the {{a}} on page {i + 1} was drawn so that"])
        legs.append({"context_options": [q.format(a=a[0]) for a in options],
                     "gold": options.index(gold),
                     "continuation": f"it had {legs_word(gold[4])} legs."})
    return [("demo_capitals_mc", "multiple_choice", 3, "world knowledge", 25.0, capitals),
            ("demo_country_facts_mc", "multiple_choice", 3, "world knowledge", 25.0, facts),
            ("demo_animal_sounds_mc", "multiple_choice", 3, "world knowledge", 25.0, sounds),
            ("demo_colours_mc", "multiple_choice", 3, "world knowledge", 25.0, colours),
            ("demo_next_day_month_lm", "language_modeling", 5, "symbolic problem solving", 0.0,
             calendar),
            ("demo_arithmetic_lm", "language_modeling", 5, "symbolic problem solving", 0.0,
             arithmetic),
            ("demo_capital_schema", "schema", 3, "commonsense reasoning", 25.0, places),
            ("demo_animal_legs_schema", "schema", 3, "commonsense reasoning", 50.0, legs)]


def chat_eval_tasks(rng):
    """{task: items} for chat_eval.py in reserved phrasings: demo-choice and demo-answer
    (ChatCORE's shapes, every accepted form), and demo-words (no instruction on the reply's form:
    does the model still answer in its own words?)."""
    def mc(question, gold, pool):
        choices = shuffled_choices(rng, gold, pool)
        return {"question": question, "choices": choices, "gold": choices.index(gold)}

    choice = [mc(f"Pick the city that serves as the seat of {r[0]}.", r[1], CAPITALS)
              for r in COUNTRIES]
    choice += [mc(f"Pick the tongue that most folk in {r[0]} use every day.", r[2], LANGUAGES)
               for r in COUNTRIES]
    choice += [mc(f"Pick the creature that stands as the emblem of {r[0]}.", r[5], ANIMAL_NAMES)
               for r in COUNTRIES]
    choice += [mc(f"Pick the noise you would hear from {article(a[0])}.", a[3], NOISES)
               for a in ANIMALS]
    choice += [mc(f"Pick the shade that {t} usually has.", c, COLOURS) for t, c in THINGS]
    # the gold letter cycles A to D: a model that answers one letter scores the chance that
    # ChatCORE's centering assumes, whichever letter it prefers
    for i, item in enumerate(choice):
        options, gold = item["choices"], item["gold"]
        options[gold], options[i % 4] = options[i % 4], options[gold]
        item["gold"] = i % 4
    answer = [{"question": f"Reply with one word: which city is the seat of {r[0]}?",
               "answers": [r[1]]}
              for r in COUNTRIES]
    answer += [{"question": f"Reply with one word: which tongue do folk in {r[0]} use?",
                "answers": [r[2]]}
               for r in COUNTRIES]
    pairs = distinct(30, lambda: (rng.randint(0, 10), rng.randint(0, 10)))
    answer += [{"question": f"Reply with the number only: what do {x} and {y} add up to?",
                "answers": [str(x + y), number_word(x + y)]} for x, y in pairs]
    answer += [{"question": f"Reply with one word: which {unit} comes straight after {seq[i]}?",
                "answers": [seq[(i + 1) % len(seq)]]}
               for seq, unit in [(DAYS, "weekday"), (MONTHS, "month")] for i in range(len(seq))]
    words = [{"question": q.format(c=r[0]), "answers": [r[1]]} for r in COUNTRIES for q in [
        "I am curious about {c}. Which of its cities runs the country?", (
        "My cousin flew to {c} last week; what is the main city there, the one with the "
        "government?")]]
    words += [{"question": q.format(c=r[0]), "answers": [r[5]]} for r in COUNTRIES for q in [
        "Every land picks a creature to stand for it. Which one did {c} pick?", (
        "If I drew the beast that represents {c}, what would I draw?")]]
    sums = [("Could you work out {x} plus {y} for me?", 1),
            ("I need the total of {x} and {y}, please.", 1),
            ("Here is a sum for you: {x} plus {y}. What does it come to?", 1),
            ("Please figure out {x} minus {y}.", -1),
            ("What remains when {y} is taken away from {x}?", -1)]
    # sums in unseen words: the calculator should still be called
    for q, sign in sums:
        for _ in range(4):
            x, y = sorted((rng.randint(11, 60), rng.randint(11, 60)), reverse=True)
            words.append({"question": q.format(x=x, y=y), "answers": [str(x + sign * y)]})
    return {"demo-choice": choice, "demo-answer": answer, "demo-words": words}


def write_eval_bundle(out_dir, rng):
    """core.yaml (plain text, no yaml library), eval_meta_data.csv, eval_data/demo/*.jsonl."""
    data_dir = out_dir / "eval_data" / "demo"
    data_dir.mkdir(parents=True, exist_ok=True)
    yaml, counts = ["icl_tasks:"], {}
    with open(out_dir / "eval_meta_data.csv", "w", newline="") as meta:
        writer = csv.writer(meta, lineterminator="\n")
        writer.writerow(["Eval Task", "Task Category", "Task Type", "Random baseline"])
        for label, kind, shots, category, baseline, items in eval_tasks(rng):
            name = label.removeprefix("demo_") + ".jsonl"
            (data_dir / name).write_text("".join(json.dumps(item) + "\n" for item in items))
            yaml += [f"- label: {label}", f"  dataset_uri: demo/{name}",
                     f"  num_fewshot: [{shots}]",
                     f"  icl_task_type: {kind}", '  continuation_delimiter: " "']
            writer.writerow([label, category, kind.replace("_", " "), baseline])
            counts[label] = len(items)
    (out_dir / "core.yaml").write_text("\n".join(yaml) + "\n")
    return counts


def write_demo(out_dir, seed=0):
    """The demo world under out_dir (README.txt last); returns counts."""
    out_dir = Path(out_dir)
    # an old last shard would pose as val
    for stale in sorted((out_dir / "pretrain").glob("shard_*.parquet")):
        stale.unlink()
    docs = demo_documents(random.Random(f"demo-docs-{seed}"))
    shards = write_text_shards(docs, out_dir / "pretrain", seed=seed, shard_docs=2 * ROW_GROUP_DOCS,
                               val_fraction=0.05)
    rng = random.Random(f"demo-chat-{seed}")
    chats = [conversation(rng) for _ in range(4000)]
    splits = {"train": [c for i, c in enumerate(chats) if i % 20], "val": chats[::20]}
    schema = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    held_out, problems, problems_rl = word_problem_sets(random.Random(f"demo-problems-{seed}"))
    rng = random.Random(f"demo-tasks-{seed}")  # a chat directory per task shape
    tasks = {"choice": pa.Table.from_pylist([choice_row(rng) for _ in range(DEMO_TASK_ROWS)]),
             "answers": pa.table({"messages": pa.array([short_answer(rng)
                                                        for _ in range(DEMO_TASK_ROWS)], schema)}),
             "calc": pa.Table.from_pylist([calculation_row(rng) for _ in range(DEMO_TASK_ROWS)]),
             "lookup": pa.Table.from_pylist([lookup_row(rng) for _ in range(DEMO_TASK_ROWS)]),
             "problems": pa.Table.from_pylist(problems),
             "problems_rl": pa.Table.from_pylist(problems_rl)}
    tables = {f"conversations/{split}": pa.table({"messages": pa.array(rows, schema)})
              for split, rows in splits.items()} | {f"{name}/train": table for name,
                                                    table in tasks.items()}
    for path, table in tables.items():
        (out_dir / path).parent.mkdir(parents=True, exist_ok=True)
        # small row groups: the loader shuffles row groups, so mixture sources interleave finely
        pq.write_table(table, out_dir / f"{path}.parquet", row_group_size=64, compression="zstd")
    evals = write_eval_bundle(out_dir / "eval_bundle", random.Random(f"demo-eval-{seed}"))
    chat_evals = chat_eval_tasks(random.Random(f"demo-chat-eval-{seed}"))
    chat_evals |= {"demo-problems": held_out}
    (out_dir / "chat_eval").mkdir(parents=True, exist_ok=True)
    for task, items in chat_evals.items():
        lines = "".join(json.dumps(item) + "\n" for item in items)
        (out_dir / "chat_eval" / f"{task}.jsonl").write_text(lines)
    chat_eval_items = {task: len(items) for task, items in chat_evals.items()}
    counts = {"documents": len(docs), "characters": sum(map(len, docs)),
              "conversations": len(chats), "eval_items": evals,
              "chat_eval_items": chat_eval_items}
    (out_dir / "README.txt").write_text(
        f"The demo world (seed {seed}): a small made-up world of {len(COUNTRIES)} countries "
        f"(capital, language, flag, national animal), {len(ANIMALS)} animals, colours of things, "
        "small arithmetic, days and months, and short stories, all consistent.\n\npretrain/      "
        f"       {counts['documents']} documents, {counts['characters']} "
        f"characters, {len(shards)} parquet shards (column `text`, row groups of {ROW_GROUP_DOCS}, "
        "zstd); the last shard is validation\nconversations/        train.parquet "
        f"({len(splits['train'])}) and val.parquet ({len(splits['val'])}): "
        "column `messages`, a list of {role, content} as in SmolTalk\nchoice/               "
        f"{DEMO_TASK_ROWS} multiple-choice questions answered by a letter, in MMLU's columns\n"
        f"answers/              {DEMO_TASK_ROWS} "
        "conversations whose reply is the answer alone (`messages`)\ncalc/                 "
        f"{DEMO_TASK_ROWS} sums through the calculator, in GSM8K's columns (<<expr=result>>, "
        f"'#### N')\nlookup/               {DEMO_TASK_ROWS} "
        "multiple-choice questions that name their answer: a letter bound to its option\n"
        "problems/             "
        f"{len(problems)} word problems of two to four steps (300 of four or five, 60 of RL's "
        f"forms) in GSM8K's columns, none among chat_eval/demo-problems' "
        f"{DEMO_HELD_OUT_PROBLEMS}\nproblems_rl/          {len(problems_rl)} more for RL, a third "
        "of four or five steps, the rest of RL's forms\neval_bundle/          "
        "the CORE formats (core.yaml, eval_meta_data.csv, eval_data/demo/*.jsonl), in phrasings "
        "no training file has\n"
        + "".join(f"    {k}: {v} items\n" for k, v in evals.items())
        + "chat_eval/            chat questions for chat_eval.py, in phrasings reserved for it\n"
        + "".join(f"    {k}: {v} items\n" for k, v in chat_eval_items.items()))
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        counts = write_demo(args.out, seed=args.seed)
    except (ValueError, OSError) as e:
        parser.exit(2, f"demo.py: error: {e}\n")
    print(f"demo: {counts['documents']:,} documents ({counts['characters']:,} characters), "
          f"{counts['conversations']:,} conversations, {sum(counts['eval_items'].values()):,} "
          f"evaluation items in {len(counts['eval_items'])} tasks, "
          f"{sum(counts['chat_eval_items'].values()):,} chat questions, under {args.out}; the "
          f"world: {len(COUNTRIES)} countries, {len(ANIMALS)} animals, {len(THINGS)} things and "
          f"their colours, {len(DAYS)} days, {len(MONTHS)} months, {len(PHRASINGS)} kinds of fact "
          f"stated in {sum(map(len, PHRASINGS.values()))} phrasings")


if __name__ == "__main__":
    main()
