"""report.py's ChatCORE sample answers: each marked right or wrong, with what was given and what was expected."""
import json

from report import marked_answers


def test_sample_answers_are_marked_right_or_wrong(tmp_path):
    items = [{"task": "demo-choice", "question": "Multiple Choice question: Pick\n- a=A", "answer": "A",
              "predicted": "A", "correct": True},
             {"task": "demo-answer", "question": "Reply with one word: X?", "answers": ["Pelmo"], "reply": "Tolvar",
              "correct": False},
             {"task": "GSM8K", "question": "q", "answer": "42", "predicted": "42", "reply": "So 42.\n#### 42",
              "correct": True}] + [{"task": "demo-choice", "question": f"q{i}", "answer": "B", "predicted": "C",
                                    "correct": False} for i in range(5)]
    path = tmp_path / "chat_eval_items.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    assert marked_answers(path, per_task=2) == [
        "- [x] demo-choice: 'Multiple Choice question: Pick - a=A' -> 'A' (expected 'A')",
        "- [ ] demo-answer: 'Reply with one word: X?' -> 'Tolvar' (expected 'Pelmo')",
        "- [x] GSM8K: 'q' -> '42' (expected '42')",
        "- [ ] demo-choice: 'q0' -> 'C' (expected 'B')"]
