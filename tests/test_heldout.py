"""The held-out split stays held out: evaluation and benchmark prompts are never training prompts,
and training never sees a user question that names a held-out topic."""
import importlib.util
from pathlib import Path

import pytest

from specdec.prompts import encode_chat
from specdec_tools import bench
from specdec_tools.distill import chat
from specdec_tools.distill.eagle_cli import held_out_free
from specdec_tools.distill.evaluate import generic_prompts

ROOT = Path(__file__).resolve().parent.parent


def training_texts(seeds=range(4)) -> set[str]:
    """The user prompts the chat data of these seeds trains on (before self-instruct)."""
    train, _ = chat.split_topics()
    return {it.messages[-1]["content"].strip().lower() for s in seeds for it in chat.seed_prompts(train, s)}


def http_bench_prompts() -> list[str]:
    spec = importlib.util.spec_from_file_location("http_bench", ROOT / "bench" / "http_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [q for qs in mod.PROMPT_SETS.values() for q in qs]


def test_generic_evaluation_prompts_are_no_training_prompts():
    _, heldout = chat.split_topics()
    items = generic_prompts(32)
    assert len(items) == 32
    texts = [it.messages[-1]["content"] for it in items]
    assert not {t.strip().lower() for t in texts} & training_texts()
    assert all(chat.mentioned_topic(t, heldout) == it.topic for t, it in zip(texts, items))


def test_benchmark_prompts_are_no_training_prompts():
    prompts = bench.CHAT + http_bench_prompts()
    assert len(prompts) > 40
    assert not {p.strip().lower() for p in prompts} & training_texts()


def test_questions_naming_a_held_out_topic_are_rejected():
    _, heldout = chat.split_topics()
    assert "electricity" in heldout and "electric cars" not in heldout
    q = "Why do electric cars need so much electricity to run?"
    assert chat.clean_question(q, "electric cars") == q  # (without a list to avoid)
    assert chat.clean_question(q, "electric cars", avoid=heldout) is None
    ok = "How far can electric cars drive on one charge?"
    assert chat.clean_question(ok, "electric cars", avoid=heldout) == ok
    assert chat.mentioned_topic("What are the moon's phases called?", heldout) == "the moon's phases"
    assert chat.mentioned_topic("Why do bees dance?", heldout) == "bees"
    assert chat.mentioned_topic("How deep is the ocean?", heldout) is None


def test_training_rows_leave_out_user_questions_naming_held_out_topics(demo_tok):
    assert "owls" in chat.heldout_topics() and "owls" in chat.all_topics("more")

    def record(*turns):
        msgs = [{"role": r, "content": c} for r, c in zip(["user", "assistant"] * 2, turns)]
        return {"prompt": encode_chat(demo_tok, msgs), "output": [1, 2], "kind": "follow-up"}

    leaked = record("Why do electric cars need so much electricity?")
    leaked_more = record("How do owls hunt at night?")  # "owls": a held-out topic of the second list
    answered = record("Tell me about the ocean.", "The ocean is home to whales and bees fly above it.",
                      "Why is that?")  # the target's own answer may name anything
    plain = record("How do I start running?")
    assert chat.user_text(demo_tok, answered["prompt"]) == "Tell me about the ocean.\nWhy is that?"
    assert held_out_free([leaked, answered, leaked_more, plain], demo_tok) == [answered, plain]


@pytest.mark.parametrize("pct", [10, 15, 25])
def test_topic_split_is_a_partition(pct):
    train, heldout = chat.split_topics(pct)
    assert set(train).isdisjoint(heldout) and sorted(train + heldout) == sorted(chat.all_topics())


def test_singular_and_plural_name_the_same_held_out_topic():
    """"volcanoes" and "volcano" name one topic (a final "e" goes after the "s", on both sides), as
    "bee"/"bees", "whale"/"whales" and "phase"/"phases" do; "be" names no "bees"."""
    _, heldout = chat.split_topics()
    assert {"volcanoes", "bees", "whales", "the moon's phases"} <= set(heldout)
    for q, topic in [("Why does a volcano erupt?", "volcanoes"), ("Why do volcanoes erupt?", "volcanoes"),
                     ("Why does a bee dance?", "bees"), ("How big is a whale?", "whales"),
                     ("What is the moon's phase tonight?", "the moon's phases")]:
        assert chat.mentioned_topic(q, heldout) == topic, q
    assert chat.mentioned_topic("What would be a good name for a cat?", heldout) is None
    assert chat.clean_question("How are mountains formed by a volcano?", "mountains", avoid=heldout) is None
