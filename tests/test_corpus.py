"""The lookup corpus (specdec.corpus): its hashed table answers what a plain dictionary of the
answers' n-grams answers, contexts never cross answers, the longest context decides, weak ones
stop a draft, and the file round-trips. (That corpus drafts keep the output plain decoding's:
tests/test_lookup.py and tests/test_lossless_proposers.py.)"""
import collections
import random

import numpy as np
import pytest

from specdec.corpus import SEP, NgramCorpus, corpus_vocab_size


def _oracle(answers, max_n, min_count, min_ratio):
    """next_token by brute force: every context of 1..max_n tokens inside an answer -> Counter."""
    table = collections.defaultdict(collections.Counter)
    for a in answers:
        for i in range(1, len(a)):
            for n in range(1, min(max_n, i) + 1):
                table[tuple(a[i - n:i])][a[i]] += 1

    def next_tokens(ctx):
        """The tokens next_token may answer (the most frequent, ties included), or None."""
        for n in range(min(max_n, len(ctx)), 0, -1):
            c = table.get(tuple(ctx[-n:]))
            if c:
                cnt = max(c.values())
                ok = cnt >= min_count and cnt >= min_ratio * sum(c.values())
                return {t for t, m in c.items() if m == cnt} if ok else None
        return None
    return next_tokens


@pytest.mark.parametrize("max_n,min_count,min_ratio", [(1, 1, 0.0), (3, 1, 0.4), (6, 2, 0.3)])
def test_table_answers_like_a_dictionary_of_ngrams(max_n, min_count, min_ratio):
    rng = random.Random(max_n)
    answers = [[rng.randrange(9) for _ in range(rng.randrange(1, 30))] for _ in range(300)]
    corpus = NgramCorpus([t for a in answers for t in (*a, SEP)], vocab_size=9, max_n=max_n,
                         min_count=min_count, min_ratio=min_ratio)
    oracle = _oracle(answers, max_n, min_count, min_ratio)
    proposed = 0
    for _ in range(2000):
        ctx = [rng.randrange(9) for _ in range(rng.randrange(1, 9))]
        want, got = oracle(ctx), corpus.next_token(ctx)
        assert (got is None) if want is None else (got in want), (ctx, want, got)
        proposed += got is not None
    assert proposed > 100


@pytest.mark.parametrize("length", [0, 1, 3, 4, 5])
def test_a_corpus_shorter_than_its_longest_context(length):
    """Fewer tokens than max_n (a tiny corpus) build a table like any other."""
    answer = list(range(1, length + 1))
    corpus = NgramCorpus(answer + [SEP], vocab_size=9, max_n=6)
    oracle = _oracle([answer], 6, 1, 0.0)
    for ctx in ([1], [1, 2], [2, 3, 4], [7]):
        want, got = oracle(ctx), corpus.next_token(ctx)
        assert (got is None) if want is None else (got in want)


def test_longest_context_decides_and_weak_ones_stop():
    answers = [[5, 1, 2, 3], [6, 1, 2, 4], [6, 1, 2, 4], [7, 1, 2, 4]]
    corpus = NgramCorpus([t for a in answers for t in (*a, SEP)], vocab_size=10)
    assert corpus.draft([5, 1, 2], 3) == [3]  # [5, 1, 2] -> 3, though [1, 2] -> 4 more often
    assert corpus.draft([9, 1, 2], 3) == [4]  # unknown [9, 1, 2]: [1, 2] decides
    assert corpus.draft([6], 5) == [1, 2, 4]  # a chain, ending where the answer did (no context after 4)
    flat = NgramCorpus([1, 2, SEP, 1, 3, SEP, 1, 4, SEP, 1, 5, SEP], vocab_size=10, min_ratio=0.4)
    assert flat.draft([1], 2) == []  # 1 is followed by four tokens equally: too weak to propose
    assert NgramCorpus([1, 2, SEP, 1, 3, SEP, 1, 2, SEP], vocab_size=10, min_count=3).draft([1], 2) == []


def test_contexts_never_cross_answers():
    corpus = NgramCorpus([1, 2, SEP, 3, 4, SEP], vocab_size=5)
    assert corpus.draft([2], 2) == []  # 2 ended its answer: nothing follows it
    assert corpus.draft([1], 3) == [2] and corpus.draft([3], 3) == [4]
    assert corpus.draft([2, 3], 1) == [4]  # [2, 3] never occurs inside an answer: [3] decides


def test_save_load_and_vocabulary(tmp_path):
    path = tmp_path / "c.npz"
    NgramCorpus.save(path, [[1, 2, 3], [1, 2, 4], [1, 2, 3]], vocab_size=7)
    assert corpus_vocab_size(path) == 7
    c = NgramCorpus.load(path)
    assert c.num_tokens == 9 and c.draft([1], 4) == [2, 3]
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        NgramCorpus([1, 2, 5], vocab_size=3)
    assert NgramCorpus(np.zeros(0, dtype=np.int32), vocab_size=3).draft([1], 2) == []


def test_worker_refuses_a_corpus_of_a_larger_vocabulary(tiny_dir):
    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    target = load_model(tiny_dir)
    with pytest.raises(ValueError, match="another model"):
        TargetWorker(target, 1, 64, corpus=NgramCorpus([0, 1], vocab_size=target.args.vocab_size + 1))


def test_specdec_corpus_reads_answers_at_the_chosen_temperatures(tiny_dir, tmp_path):
    import json
    from specdec_tools.make_corpus import main
    rows = [{"prompt": [9, 8, 7, 1, 2], "output": [3, 4, 5], "temperature": 0.0},
            {"prompt": [1, 2], "output": [3, 6], "temperature": 1.0},  # not kept
            {"topic": "a question, no answer"}]
    (tmp_path / "answers.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    (tmp_path / "more.jsonl").write_text(json.dumps({"prompt": [2], "output": [3, 4, 6], "temperature": 0.7}) + "\n")
    out = tmp_path / "c.npz"
    main(["--answers", str(tmp_path), "--target", str(tiny_dir), "--out", str(out), "--prompt-tail", "2"])
    with np.load(out) as f:
        assert f["tokens"].tolist() == [1, 2, 3, 4, 5, SEP, 2, 3, 4, 6, SEP]
    c = NgramCorpus.load(out)
    d = c.draft([2], 3)
    assert d[:2] == [3, 4] and d[2] in (5, 6)  # 4 -> 5 and 4 -> 6 tie at 50% (>= 40%): either
    assert c.draft([9, 1, 2], 1) == [3]


def test_a_corpus_token_equal_to_the_vocab_size_is_refused():
    NgramCorpus([0, 4, -1, 3], vocab_size=5)
    with pytest.raises(ValueError, match="corpus tokens"):
        NgramCorpus([0, 5, -1, 3], vocab_size=5)


def test_the_corpus_continues_a_prompt_lookup_draft_from_its_end():
    """A lookup draft that ends short is continued by the corpus after the draft's own last
    tokens (the sequence as it will read), not after the sequence's."""
    from specdec.target_worker import lookup_draft
    answers = [[3, 1, 2, 3, 1, 2, 7], [1, 2, 3, 1, 2, 8], [1, 2, 3, 1, 2, 8]]
    corpus = NgramCorpus([t for a in answers for t in (*a, SEP)], vocab_size=10, max_n=6)
    assert corpus.draft([1, 2, 3, 1, 2], 1) == [8]  # after the sequence itself: 8
    assert lookup_draft([1, 2, 3, 1, 2], 5, corpus) == [3, 1, 2, 7]  # after "... 3 1 2" + draft "3 1 2": 7


def test_specdec_corpus_merges_packed_answers_and_corpora_once_each_without_excluded_questions(tiny_dir, tmp_path):
    """`--packed` takes a corpus's segments whole and a packed file's answers after their prompts'
    tails, at the chosen temperatures; a segment already there is not added again (its counts
    would double), and an answer to a question in `--exclude-prompts`, or to one that names a held-out
    topic of the distillation's split, is dropped."""
    from specdec.loader import load_tokenizer
    from specdec_tools.distill.packed import pack
    from specdec_tools.make_corpus import main
    tok = load_tokenizer(str(tiny_dir))
    asked = tok.encode("why is the sky blue", add_special_tokens=False)
    other = tok.encode("tell me a story", add_special_tokens=False)
    from specdec_tools.distill.chat import split_topics
    heldout = tok.encode(f"tell me about {split_topics()[1][0]}", add_special_tokens=False)
    old = tmp_path / "old.npz"
    NgramCorpus.save(old, [[7, 1, 2, 3], [5, 6]], vocab_size=tok.vocab_size)
    packed = pack(tmp_path / "data.npz", [
        {"kind": "task", "temperature": 0.0, "prompt": other + [7, 1], "output": [2, 3]},  # = an old segment
        {"kind": "task", "temperature": 0.0, "prompt": other + [9], "output": [4, 4]},
        {"kind": "task", "temperature": 1.0, "prompt": other + [9], "output": [8, 8]},  # not at --temperatures
        {"kind": "task", "temperature": 0.7, "prompt": asked + [9], "output": [6, 6]},  # an excluded question
        {"kind": "task", "temperature": 0.0, "prompt": heldout + [9], "output": [6, 5]},  # names a held-out topic
    ])
    (tmp_path / "q.txt").write_text("Why is the sky BLUE\n\n")
    out = tmp_path / "c.npz"
    main(["--packed", str(old), str(packed), "--target", str(tiny_dir), "--out", str(out), "--prompt-tail", "2",
          "--exclude-prompts", str(tmp_path / "q.txt")])
    with np.load(out) as f:
        assert f["tokens"].tolist() == [7, 1, 2, 3, SEP, 5, 6, SEP, other[-1], 9, 4, 4, SEP]
