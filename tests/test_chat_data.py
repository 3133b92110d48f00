"""Everyday-chat distillation data (specdec_tools.distill.chat): the topic split, the prompts, the
question filter, and the answers pipeline (greedy + sampled, second turns, resumable)."""
from __future__ import annotations

import json

import pytest

from specdec_tools.distill import chat, main
from specdec_tools.distill.answers import read_jsonl
from specdec_tools.distill.eagle_cli import _temperatures


@pytest.fixture
def five_topics(monkeypatch):
    """Five everyday topics: at --heldout-chat-pct 30, three train and two are held out."""
    monkeypatch.setattr(chat, "TOPICS", {"x": ["baking bread", "chess", "yoga", "deserts", "bees"]})
    monkeypatch.setattr(chat, "MORE_TOPICS", {})


def _pipeline_args(tiny_dir, chat_answers: int, follow_up_frac: float = 0.0) -> list[str]:
    """`specdec-distill --arch eagle` on the tiny target, sized for seconds: answers only (no training steps)."""
    return ["--arch", "eagle", "--target", str(tiny_dir), "--draft-vocab", "64", "--seq-len", "128",
            "--batch-tokens", "512", "--corpus-limit", "50", "--answers", "2", "--gen-batch", "8",
            "--gen-tokens", "12", "--text-tokens", "256", "--eval-prompts", "0", "--threads", "1",
            "--dtype-teacher", "float32", "--save-dtype", "float32", "--steps", "0",
            "--chat-answers", str(chat_answers), "--questions-per-topic", "1",
            "--follow-up-frac", str(follow_up_frac), "--heldout-chat-pct", "30"]


def test_topic_split_is_disjoint_and_covers_every_domain_kind():
    train, held = chat.split_topics(15)
    assert set(train).isdisjoint(held) and sorted(train + held) == sorted(chat.all_topics())
    assert 0.08 < len(held) / len(chat.all_topics()) < 0.25
    items = chat.seed_prompts(train)
    assert items == chat.seed_prompts(train)  # deterministic
    assert {it.kind for it in items} == {"task", "rewrite", "math", "code"}
    assert {it.topic for it in items} == set(train)
    held_words = [t for t in held if len(t) > 12]  # no training prompt is about a held-out topic
    assert not [it for it in items for t in held_words if t in it.messages[0]["content"]]


@pytest.mark.parametrize("text, topic, want", [
    ('What is the best way to bake bread?" and more', "baking bread", "What is the best way to bake bread?"),
    ("A curious person might ask: Why do bees dance?", "bees", "Why do bees dance?"),
    ("Why do onions make you cry?", "bees", None),  # not about the topic
    ("Can you help me as an AI assistant with chess?", "chess", None),  # about the assistant
    ("Chess is fun.", "chess", None),  # not a question
    ("Chess?", "chess", None),  # too short
])
def test_clean_question(text, topic, want):
    assert chat.clean_question(text, topic) == want


def test_self_instruct_asks_again_for_more_questions_and_keeps_the_first(tiny_tok, tmp_path, monkeypatch):
    """Raising `per_topic` on a cached run asks topics again (fresh seeds, a new attempt) and
    returns the old questions first, in their old order, so cached answers keep their index."""
    import re
    from types import SimpleNamespace

    from specdec_tools.distill import answers

    class FakeEngine:  # writes one question per (topic, seed): "How does <topic> work, case <seed>?"
        def generate(self, prompts, params):
            topics = [re.findall(r'about (.+?): "', tiny_tok.decode(p))[-1] for p in prompts]
            return [SimpleNamespace(output_ids=tiny_tok(f'How does {t} work, case {sp.seed}?"',
                                                        add_special_tokens=False).input_ids)
                    for t, sp in zip(topics, params)]

    monkeypatch.setattr(answers, "plain_engine", lambda *a, **k: FakeEngine())
    path, topics = tmp_path / "q.jsonl", ["chess", "bees"]
    first = chat.self_instruct(None, tiny_tok, topics, 2, path, batch=8)
    assert [len(a) for a in first] == [4, 0, 0]
    again = chat.self_instruct(None, tiny_tok, topics, 2, path, batch=8)
    assert again == first  # enough questions cached: nothing is asked
    more = chat.self_instruct(None, tiny_tok, topics, 5, path, batch=8)
    assert more[0] == first[0] and len(more[1]) == 6 and not more[2]
    texts = [it.messages[0]["content"] for a in more for it in a]
    assert len(set(texts)) == len(texts)  # new seeds, no duplicates
    assert all(json.loads(x)["attempt"] in (0, 1) for x in path.read_text().splitlines())
    assert chat.self_instruct(None, tiny_tok, topics, 5, path, batch=8) == more  # asked for 5 once: not again


def test_temperatures_and_follow_ups():
    t = _temperatures(40, 0.5)
    assert t.count(0.0) == 20 and t.count(0.7) == 10 and t.count(1.0) == 10
    assert _temperatures(7, 0.0) == [0.0] * 7
    items = chat.seed_prompts(["chess", "bees"])[:3]
    two = chat.follow_ups(items, ["An answer.", "", "Another."])
    assert len(two) == 2 and all(it.kind == "follow-up" for it in two)
    assert [m["role"] for m in two[0].messages] == ["user", "assistant", "user"]
    assert two[0].messages[:1] == items[0].messages and two[0].messages[1]["content"] == "An answer."


def test_chat_answers_pipeline_resumes_and_mixes_temperatures(tiny_dir, tmp_path, one_thread, five_topics):
    args = _pipeline_args(tiny_dir, chat_answers=20, follow_up_frac=0.25)
    work = tmp_path / "d.work"
    m = main([*args, "--out", str(tmp_path / "d")])
    first = [json.loads(x) for x in (work / "chat_answers.jsonl").read_text().splitlines()]
    second = [json.loads(x) for x in (work / "chat_follow_ups.jsonl").read_text().splitlines()]
    assert len(first) == 15 and len(second) == 5 and m["data"]["answers"] == 2 + 20
    assert {r["temperature"] for r in first} == {0.0, 0.7, 1.0}
    assert all(r["output"] for r in first + second)
    assert {json.loads(x)["topic"] for x in (work / "questions.jsonl").read_text().splitlines()} <= set(
        chat.split_topics(30)[0])
    # a rerun finds everything cached; regenerating from scratch writes the same answers (seeded)
    before = (work / "chat_answers.jsonl").read_text()
    main([*args, "--out", str(tmp_path / "d")])
    assert (work / "chat_answers.jsonl").read_text() == before
    (work / "chat_answers.jsonl").unlink()
    (work / "chat_follow_ups.jsonl").unlink()
    (work / "features.pt").unlink()
    main([*args, "--out", str(tmp_path / "d")])
    assert sorted((work / "chat_answers.jsonl").read_text().splitlines()) == sorted(before.splitlines())
    # a second, sampled answer per first-turn prompt, at the temperature its first answer did not use
    m = main([*args, "--out", str(tmp_path / "d"), "--resample-minutes", "5"])
    again = {r["i"]: r for r in map(json.loads, (work / "chat_answers.jsonl").read_text().splitlines())}
    resampled = [json.loads(x) for x in (work / "chat_resampled.jsonl").read_text().splitlines()]
    assert len(resampled) == 15 and m["data"]["answers"] == 2 + 20 + 15
    for r in resampled:
        assert r["prompt"] == again[r["i"]]["prompt"] and r["temperature"] in (0.7, 1.0)
        assert r["temperature"] != again[r["i"]]["temperature"]


def test_chat_seed_makes_new_conversations_and_keeps_the_split_and_the_code_data(tiny_dir, tmp_path, one_thread,
                                                                               five_topics):
    args = _pipeline_args(tiny_dir, chat_answers=12)
    read = lambda work, name: read_jsonl(work / name)  # noqa: E731
    runs = {}
    for seed in (None, 0, 1):
        work = tmp_path / f"seed{seed}.work"
        main([*args, "--out", str(tmp_path / f"seed{seed}"), *(["--chat-seed", str(seed)] if seed is not None else [])])
        runs[seed] = work
    assert read(runs[0], "chat_answers.jsonl") == read(runs[None], "chat_answers.jsonl")  # default: --seed
    assert read(runs[1], "answers.jsonl") == read(runs[0], "answers.jsonl")  # the code data does not move
    old = {tuple(r["prompt"]) for r in read(runs[0], "chat_answers.jsonl")}
    new = read(runs[1], "chat_answers.jsonl")
    assert len(new) == 12 and sum(tuple(r["prompt"]) not in old for r in new) >= 6
    train = set(chat.split_topics(30)[0])
    assert {r["topic"] for r in read(runs[1], "questions.jsonl")} <= train


def test_packed_answers_carry_a_run_s_data_into_the_next(tiny_dir, tmp_path, one_thread, five_topics):
    from specdec_tools.distill import packed
    args = _pipeline_args(tiny_dir, chat_answers=6)
    f = tmp_path / "run1.npz"
    m = main([*args, "--out", str(tmp_path / "a"), "--pack-data", str(f)])
    assert m["data"]["answers"] == 8
    made = [r for name in ("answers.jsonl", "chat_answers.jsonl") for r in read_jsonl(tmp_path / "a.work" / name)]
    keep = lambda r: (r["kind"], r["temperature"], r["prompt"], r["output"])  # noqa: E731
    assert sorted(map(keep, packed.unpack(f))) == sorted(map(keep, made))
    # a later run with other conversations trains on both; its own answers and a repeated file count once
    m = main([*args, "--out", str(tmp_path / "b"), "--chat-seed", "1", "--data", str(f), str(f)])
    own = [r for name in ("answers.jsonl", "chat_answers.jsonl") for r in read_jsonl(tmp_path / "b.work" / name)]
    distinct = {(tuple(r["prompt"]), tuple(r["output"])) for r in made + own}
    assert len(own) == 8 and len(distinct) > 8  # the same two code answers; new conversations
    assert m["data"]["answers"] == len(distinct)


def test_a_lookup_corpus_reads_as_packed_answers(tmp_path):
    from specdec.corpus import NgramCorpus
    from specdec_tools.distill import packed
    NgramCorpus.save(tmp_path / "c.npz", [[5, 6, 7], [8, 9]], vocab_size=16)
    assert [(r["kind"], r["prompt"], r["output"]) for r in packed.unpack(tmp_path / "c.npz")] == [
        ("corpus", [], [5, 6, 7]), ("corpus", [], [8, 9])]


def test_chat_topics_more_draws_its_prompts_from_the_second_list(tiny_dir, tmp_path, one_thread, monkeypatch):
    """--chat-topics more: the questions (and so the answers) are about the second list's training
    topics only; base (the default) stays on the first list."""
    monkeypatch.setattr(chat, "TOPICS", {"x": ["baking bread", "chess", "yoga", "deserts", "bees"]})
    monkeypatch.setattr(chat, "MORE_TOPICS", {"y": ["owls", "comets", "tennis", "kites", "jigsaw puzzles"]})
    train_more = set(chat.split_topics(30, "more")[0])
    assert train_more and train_more <= set(chat.MORE_TOPICS["y"])
    for topics, want in (("more", train_more), ("base", set(chat.split_topics(30)[0]))):
        work = tmp_path / f"{topics}.work"
        main([*_pipeline_args(tiny_dir, chat_answers=8), "--out", str(tmp_path / topics), "--chat-topics", topics])
        assert {r["topic"] for r in read_jsonl(work / "questions.jsonl")} == want


def test_the_second_topic_list_is_split_like_the_first_and_leaks_into_neither():
    """MORE_TOPICS: no topic in both lists; its held-out share by the same rule; no training topic of
    either list names a held-out topic of either (its prompts would leak it); `heldout_topics`, what
    training filters on, holds both lists' held-out topics; evaluation's generic prompts stay on the
    first list's, so figures compare across runs."""
    from specdec_tools.distill.evaluate import generic_prompts
    base, more = chat.all_topics("base"), chat.all_topics("more")
    assert not set(base) & set(more) and len(more) == len(set(more)) and chat.all_topics("all") == base + more
    train_more, held_more = chat.split_topics(15, "more")
    assert 0.08 < len(held_more) / len(more) < 0.25
    held = chat.heldout_topics(15)
    assert set(held) == set(chat.split_topics(15)[1]) | set(held_more)
    assert [t for t in chat.split_topics(15, "all")[0] if chat.mentioned_topic(t, held)] == []
    assert {it.topic for it in chat.seed_prompts(train_more, 3)} == set(train_more)
    assert {it.topic for it in generic_prompts(32)} <= set(chat.split_topics(15)[1])
