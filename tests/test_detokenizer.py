"""Incremental detokenization (specdec/detokenizer.py) as Sequence uses it: text equal to a full
decode, streamed deltas that add up to the final text whatever the tokenizer, stop strings across
token boundaries and inside a round's run, and a decoding cost linear in the output length."""
from __future__ import annotations

import inspect
import random
import textwrap

import pytest

from specdec.sampling import SamplingParams
from specdec.sequence import Sequence
from tiny_models import tiny_tokenizer

SAMPLES = ["héllo wörld", "中文字符 测试", "emoji 🎉🚀 and 👩‍👩‍👧 done", "naïve café — ok",
           "plain ascii text.", "Ωμέγα ß ∑ ≠ ", "\ufffd literal", "tabs\tand\r\nnewlines\n"]


class CountingTokenizer:
    """A tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, tok) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


@pytest.fixture(scope="module")
def tiny():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def cleanup_tok():
    """A WordPiece tokenizer whose decode cleans up spaces: "a ' b" -> "a'b", "a ." -> "a."."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[SEP]", "a", "b", "it", "do", "go", ".", ",", "'", "?", "!", "s", "n't", "##s", "##ing"]
    t = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece(cleanup=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", sep_token="[SEP]",
                                  clean_up_tokenization_spaces=True)
    assert tok.decode([2, 9, 3]) == "a'b" and tok.decode([2, 7]) == "a."
    return tok


def random_ids(tok, rng: random.Random, pieces: int = 8) -> list[int]:
    """Ids of random multilingual/emoji text with special tokens and random vocab ids (possibly lone
    UTF-8 bytes) spliced in."""
    specials = sorted(tok.added_tokens_decoder)
    ids: list[int] = []
    for _ in range(pieces):
        ids += tok(rng.choice(SAMPLES), add_special_tokens=False).input_ids
        r = rng.random()
        if r < 0.3:
            ids.append(rng.choice(specials))
        elif r < 0.6:
            ids += [rng.randrange(len(tok)) for _ in range(rng.randint(1, 3))]
    return ids


def generate(tok, ids: list[int], rng: random.Random, stop: list[str] | None = None) -> tuple[Sequence, list[str]]:
    """Append `ids` in rounds of 1..5 tokens, taking a delta after each round."""
    seq = Sequence([1], SamplingParams(max_tokens=len(ids), stop=stop or []))
    deltas, i = [], 0
    while i < len(ids) and not seq.finished:
        n = rng.randint(1, 5)
        seq.append(ids[i:i + n], tok)
        i += n
        deltas.append(seq.take_delta())
    return seq, deltas


def check_full_decode(tok, seed: int) -> None:
    rng = random.Random(seed)
    ids = random_ids(tok, rng)
    seq = Sequence([1], SamplingParams(max_tokens=len(ids)))
    deltas, i = [], 0
    while not seq.finished:
        n = rng.randint(1, 5)
        seq.append(ids[i:i + n], tok)
        i += n
        assert tok.decode(ids[:i], skip_special_tokens=True).startswith(seq.text)  # final text only
        deltas.append(seq.take_delta())
    assert seq.finish_reason == "length"
    assert seq.text == tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == seq.text


# ---- (a) incremental text == decoding everything at once --------------------------------------
@pytest.mark.parametrize("seed", range(30))
def test_text_equals_full_decode_tiny_tokenizer(tiny, seed):
    check_full_decode(tiny, seed)


@pytest.mark.slow
def test_text_equals_full_decode_demo_tokenizer(demo_tok):
    for seed in range(30):
        check_full_decode(demo_tok, seed)


def test_incomplete_character_is_held_back(tiny):
    ids = tiny("🎉", add_special_tokens=False).input_ids
    assert len(ids) > 1  # bytes of one character in several tokens
    seq = Sequence([1], SamplingParams(max_tokens=10))
    for t in ids[:-1]:
        seq.append([t], tiny)
        assert seq.take_delta() == "" and seq.text == ""
    seq.append(ids[-1:], tiny)
    assert seq.take_delta() == "🎉"


def test_incomplete_character_at_the_end_is_kept(tiny):
    ids = tiny("ab🎉", add_special_tokens=False).input_ids[:-1]  # cut inside the emoji
    seq = Sequence([1], SamplingParams(max_tokens=len(ids)))
    seq.append(ids, tiny)
    assert seq.finish_reason == "length"
    assert seq.text == tiny.decode(ids) and seq.text.endswith("\ufffd")



def test_pending_text_is_only_what_is_held_back(tiny):
    """`pending` (searched for stop strings beside the text) is the provisional text of the held
    tokens: once they are emitted it is empty, or a stop string could match text twice over."""
    from specdec.detokenizer import IncrementalDetokenizer
    ids = tiny("a🎉", add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tiny)
    for t in ids[:-1]:
        d.push(t)
    assert d.text == "a" and d.pending.endswith("\ufffd")
    d.push(ids[-1])
    assert d.text == "a🎉" and d.pending == ""


def test_a_prompt_ending_inside_a_character_leaves_the_output_its_own_bytes(tiny):
    """A prompt cut inside a character (a token-id prompt, a raw completion) must not lend its first
    bytes to the output: the output's text is its own ids' decode, the lone continuation bytes
    included, and the rest of it is not shifted."""
    ids = tiny("ab🎉cd", add_special_tokens=False).input_ids
    emoji = tiny("🎉", add_special_tokens=False).input_ids
    cut = len(tiny("ab", add_special_tokens=False).input_ids) + 1  # one byte of the emoji in the prompt
    assert len(emoji) > 1 and ids[cut - 1] == emoji[0]
    out = ids[cut:]
    seq = Sequence(ids[:cut], SamplingParams(max_tokens=len(out)))
    seq.append(out, tiny)
    assert seq.text == tiny.decode(out, skip_special_tokens=True) and seq.text.endswith("cd")

# ---- (b) streaming is consistent with the final text for any decode ---------------------------
def test_cleanup_tokenizer_deltas_add_up_to_text(cleanup_tok):
    seq = Sequence([1], SamplingParams(max_tokens=3))
    deltas = []
    for t in (2, 9, 3):  # "a", "'", "b": decoding all three at once gives "a'b"
        seq.append([t], cleanup_tok)
        deltas.append(seq.take_delta())
    assert "".join(deltas) == seq.text


@pytest.mark.parametrize("stop", [None, ["it's"], [" . ", "n't"]])
@pytest.mark.parametrize("seed", range(10))
def test_cleanup_tokenizer_random_streams(cleanup_tok, seed, stop):
    rng = random.Random(seed)
    ids = [rng.randrange(2, len(cleanup_tok)) for _ in range(60)]
    seq, deltas = generate(cleanup_tok, ids, rng, stop=stop)
    assert seq.finished
    assert "".join(deltas) == seq.text
    assert not any(s in seq.text for s in stop or [])


# ---- (c) stop strings ------------------------------------------------------------------------
SOURCE = "def foo(bar):\n    return bar + 1\n\nclass Baz:\n    pass\n"


def boundary_stop(tok, text: str) -> tuple[list[int], str]:
    """Ids of `text` and a 4-char stop string that spans the boundary between two tokens."""
    ids = tok(text, add_special_tokens=False).input_ids
    ends = [len(tok.decode(ids[:j + 1])) for j in range(len(ids))]
    k = next(e for e in ends[2:] if e + 2 <= len(text) and text[e - 2:e + 2].strip())
    return ids, text[k - 2:k + 2]


def first_completing(tok, ids: list[int], stop: str) -> int:
    """How many tokens it takes for `stop` to appear in the decoded text."""
    return next(j for j in range(1, len(ids) + 1) if stop in tok.decode(ids[:j]))


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_stop_string_across_tokens_inside_a_run(tiny, one_at_a_time):
    ids, stop = boundary_stop(tiny, SOURCE)
    j = first_completing(tiny, ids, stop)
    seq = Sequence([1], SamplingParams(max_tokens=100, stop=["never", stop]))
    deltas = []
    if one_at_a_time:
        kept = 0
        for t in ids:
            kept += seq.append([t], tiny)
            deltas.append(seq.take_delta())
    else:
        kept = seq.append(ids, tiny)  # one round's accepted run holding the stop
        deltas.append(seq.take_delta())
    assert seq.finish_reason == "stop"
    assert kept == j and seq.output_ids == ids[:j]  # nothing after the stop is kept
    assert seq.text == SOURCE[:SOURCE.index(stop)]
    assert "".join(deltas) == seq.text


def test_earliest_stop_string_wins(tiny):
    seq = Sequence([1], SamplingParams(max_tokens=100, stop=["Baz", "bar"]))
    seq.append(tiny(SOURCE, add_special_tokens=False).input_ids, tiny)
    assert seq.finish_reason == "stop" and seq.text == "def foo("


def test_of_stop_strings_completed_by_one_token_the_one_that_starts_first_wins(tiny):
    """"(" completes "o(" and "(" at once: the text ends before the earlier start, "o("."""
    for stop in (["o(", "("], ["(", "o("]):
        seq = Sequence([1], SamplingParams(max_tokens=100, stop=stop))
        for t in tiny(SOURCE, add_special_tokens=False).input_ids:
            seq.append([t], tiny)
        assert seq.finish_reason == "stop" and seq.text == "def fo", stop


def test_ignore_eos_keeps_generating_past_the_end_of_sequence_token(tiny):
    ids = tiny("def foo", add_special_tokens=False).input_ids
    eos = frozenset({tiny.eos_token_id})
    for ignore, want in ((True, len(ids) + 1), (False, 2)):  # (the end token itself is kept, without text)
        seq = Sequence([1], SamplingParams(max_tokens=100, ignore_eos=ignore), eos_token_ids=eos)
        kept = seq.append([ids[0], tiny.eos_token_id, *ids[1:]], tiny)
        assert kept == want and seq.finished == (not ignore), ignore


def test_stop_string_with_a_multibyte_character(tiny):
    ids = tiny("xyab中cd", add_special_tokens=False).input_ids
    seq = Sequence([1], SamplingParams(max_tokens=100, stop=["b中"]))
    deltas = []
    for t in ids:
        seq.append([t], tiny)
        deltas.append(seq.take_delta())
    assert seq.finish_reason == "stop" and seq.text == "xya"
    assert seq.output_ids == ids[:first_completing(tiny, ids, "b中")]
    assert "".join(deltas) == "xya"


def test_stream_holds_back_a_possible_stop_prefix(tiny):
    seq = Sequence([1], SamplingParams(max_tokens=100, stop=["END"]))
    seq.append(tiny("abcEN", add_special_tokens=False).input_ids, tiny)
    assert seq.take_delta() == "abc"
    seq.append(tiny("D tail", add_special_tokens=False).input_ids, tiny)
    assert seq.finish_reason == "stop" and seq.text == "abc" and seq.take_delta() == ""


def test_stop_token_id_ends_without_its_text(tiny):
    ids = tiny(SOURCE, add_special_tokens=False).input_ids
    seq = Sequence([1], SamplingParams(max_tokens=100, stop_token_ids=list(range(1000, 1256)) + [ids[3]]))
    assert seq.append(ids, tiny) == 4
    assert seq.finish_reason == "stop" and seq.output_ids == ids[:4]
    assert seq.text == tiny.decode(ids[:3])


# ---- (d) decoding cost is linear in the output length ----------------------------------------
N = 4096


def long_ids(tok, kind: str) -> list[int]:
    """N output ids: source text with multibyte text, a run of U+FFFD characters (which look like
    an incomplete character to the detokenizer), or a run of special tokens."""
    if kind == "text":
        text = (inspect.getsource(textwrap) + "中文 🎉 héllo ") * 20
        return tok(text, add_special_tokens=False).input_ids[:N]
    if kind == "replacement":
        return tok("\ufffd" * N, add_special_tokens=False).input_ids[:N]
    return [tok.eos_token_id] * N


@pytest.mark.parametrize("kind", ["text", "replacement", "specials"])
def test_decoding_cost_is_linear(tiny, kind):
    ids = long_ids(tiny, kind)
    assert len(ids) == N
    counting = CountingTokenizer(tiny)
    seq = Sequence([1], SamplingParams(max_tokens=N, stop=["\x00never"]))  # eos not in eos_token_ids
    streamed = []
    for t in ids:
        seq.append([t], counting)
        streamed.append(seq.take_delta())
    assert counting.decoded < 20 * N  # re-decoding the whole output each token: ~N^2 / 2
    assert seq.finish_reason == "length" and seq.text == tiny.decode(ids, skip_special_tokens=True)
    assert "".join(streamed) == seq.text


# ---- (e) tokens that decode to nothing, and the prompt as context ----------------------------
def test_a_run_of_special_tokens_holds_nothing_back(tiny):
    """Special tokens (dropped by decode) never count as held text: a stop string after a run of
    them ends the sequence at once, not at the next power of two of held tokens."""
    special = tiny.eos_token_id
    body = tiny(" Hello STOP and some more text after the stop string", add_special_tokens=False).input_ids
    j = first_completing(tiny, body, "STOP")
    seq = Sequence([1], SamplingParams(max_tokens=200, stop=["STOP"]))  # (eos not among its eos ids)
    for t in [special] * 40 + body:
        seq.append([t], tiny)
    assert seq.finish_reason == "stop" and seq.text == " Hello "
    assert seq.num_output == 40 + j


@pytest.fixture(scope="module")
def sentencepiece_tok():
    """A Llama 2 / Mistral-layout tokenizer: "▁" marks a word's space and decode strips the
    leading space of what it decodes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    corpus = ["The capital of France is Paris. The capital of Japan is Tokyo. Hello world, the cat sat."] * 20
    t.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=["▁"] + [chr(c) for c in range(32, 127)]))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert tok.decode(tok("Paris", add_special_tokens=False).input_ids) == "Paris"  # the stripped space
    return tok


@pytest.mark.parametrize("prompt, answer", [("The capital of France is", "Paris. Hello world."),
                                            ("Hello", "world, the cat sat."), ("The cat", "Tokyo")])
def test_first_word_keeps_its_space_after_the_prompt(sentencepiece_tok, prompt, answer):
    tok = sentencepiece_tok
    p = [tok.bos_token_id] + tok(prompt, add_special_tokens=False).input_ids
    out = tok(answer, add_special_tokens=False).input_ids  # "▁Paris", ...: a word after a space
    expected = tok.decode(p + out, skip_special_tokens=True)[len(tok.decode(p, skip_special_tokens=True)):]
    assert expected == " " + answer
    seq = Sequence(p, SamplingParams(max_tokens=len(out)))
    deltas = []
    for t in out:
        seq.append([t], tok)
        deltas.append(seq.take_delta())
    assert seq.text == expected and "".join(deltas) == expected
