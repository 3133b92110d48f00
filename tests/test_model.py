"""The compact runner against the transformers reference, ragged batches and cache rollback."""
import time

import pytest
import torch

from specdec.loader import ModelLoadError, load_hf_model, load_model, resolve
from specdec import runner
from specdec.runner import SlotTable, chunk_bounds, run_ragged


def _ref_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def test_matches_transformers_tiny(tiny_dir, tiny_tok):
    hf, model = load_hf_model(tiny_dir), load_model(tiny_dir)
    model.setup_cache(2, 128)
    ids = tiny_tok("def add(a, b):\n    return a + b").input_ids
    with torch.inference_mode():
        logits, _ = model(torch.tensor([ids]), torch.tensor([1]), torch.tensor([0]), n_logits=len(ids))
    assert torch.allclose(logits[0], _ref_logits(hf, ids), atol=1e-4)


@pytest.mark.slow
def test_matches_transformers_demo(demo_dir, demo_model, demo_tok):
    hf = load_hf_model(demo_dir)
    ids = demo_tok("The capital of France is").input_ids
    demo_model.setup_cache(1, 64)
    with torch.inference_mode():
        logits, _ = demo_model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), n_logits=len(ids))
    ref = _ref_logits(hf, ids)
    assert (logits[0] - ref).abs().max() < 1e-3
    assert torch.equal(logits[0].argmax(-1), ref.argmax(-1))


def test_ragged_batch_equals_single_rows(tiny_dir, tiny_tok):
    """Rows with different lengths and positions in one forward == each row alone."""
    model = load_model(tiny_dir)
    model.setup_cache(4, 128)
    prompts = [tiny_tok(t).input_ids for t in ("import os", "class Foo(object):\n    pass", "x = 1")]
    with torch.inference_mode():
        # prefill each row alone in slots 0..2, then one ragged step with 1, 3 and 2 new tokens
        for s, p in enumerate(prompts):
            run_ragged(model, [p], [s], [0], [1])
        feeds = [[5, 6, 7][:n] for n in (1, 3, 2)]
        batched = run_ragged(model, feeds, [0, 1, 2], [len(p) for p in prompts], [len(f) for f in feeds])
        for s, (p, f) in enumerate(zip(prompts, feeds)):
            alone = run_ragged(model, [p + f], [3], [0], [len(f)])[0]
            assert torch.allclose(batched[s], alone, atol=1e-4)


def test_rollback_is_moving_a_length(tiny_dir):
    """Writing rejected positions then rewriting them gives the same logits as never writing."""
    model = load_model(tiny_dir)
    model.setup_cache(2, 64)
    prompt = [10, 11, 12, 13]
    with torch.inference_mode():
        run_ragged(model, [prompt], [0], [0], [1])
        run_ragged(model, [[20, 21, 22]], [0], [4], [3])  # speculative tokens, all "rejected"
        after = run_ragged(model, [[30]], [0], [4], [1])[0]  # overwrite from position 4
        ref = run_ragged(model, [prompt + [30]], [1], [0], [1])[0]
    assert torch.allclose(after, ref, atol=1e-5)


def test_chunk_bounds_cut_at_positions_whatever_follows_the_prompt():
    assert chunk_bounds(0, 300, 1, 128) == [(0, 128), (128, 256), (256, 300)]
    assert chunk_bounds(100, 100, 1, 128) == [(100, 128), (128, 200)]  # cuts at multiples, not every 128 tokens
    assert chunk_bounds(0, 10, 1, 128) == [(0, 10)]
    for prompt in (255, 256, 257, 300):  # the same prompt with 4 drafts after it (tail 5): the prompt's cuts stay
        plain, spec = chunk_bounds(0, prompt, 1, 128), chunk_bounds(0, prompt + 4, 5, 128)
        assert [b for _, b in plain[:-1]] == [b for _, b in spec[:-1]]
        assert spec[-1][1] - spec[-1][0] >= 5  # the logits the round reads come from one call


@pytest.mark.parametrize("hidden", [0, 40, 150])  # features of no, the last 40, every position
def test_a_long_row_runs_in_chunks_with_the_logits_and_features_of_one_call(tiny_dir, monkeypatch, hidden):
    """Chunked prefill: a prompt longer than PREFILL_CHUNK runs in calls of at most that many
    positions, and gives the logits (and features of every position) of one whole call."""
    model = load_model(tiny_dir)
    model.setup_cache(2, 256)
    ids = [(7 * i) % 500 + 3 for i in range(150)]
    with torch.inference_mode():
        whole = run_ragged(model, [ids], [0], [0], [3], return_hidden=bool(hidden), n_hidden=[hidden or 3])
        monkeypatch.setattr(runner, "PREFILL_CHUNK", 32)
        calls = []
        forward = model.forward

        def counted(tokens, *a, **kw):
            calls.append(tokens.shape[1])
            return forward(tokens, *a, **kw)
        monkeypatch.setattr(model, "forward", counted)
        chunked = run_ragged(model, [ids], [1], [0], [3], return_hidden=bool(hidden), n_hidden=[hidden or 3])
    assert calls == [32, 32, 32, 32, 22]
    if hidden:
        (whole, whole_h), (chunked, chunked_h) = whole, chunked
        assert chunked_h[0].shape == whole_h[0].shape == (hidden, model.args.hidden_size)
        assert torch.allclose(chunked_h[0], whole_h[0], atol=1e-4)
    assert chunked[0].shape == whole[0].shape == (3, model.args.vocab_size)
    assert torch.allclose(chunked[0], whole[0], atol=1e-4)


def test_a_prompts_chunks_before_its_last_attend_with_sdpa(tiny_dir, monkeypatch):
    """Chunks that end before the prompt's last token run SDPA (exact=False); the chunk with that
    token (its logits are the first output token's; drafts follow it) and those after it (a
    re-prefill's generated tokens) keep the model's own attention; every chunk of a part of a
    prompt (chunked prefill across rounds) runs SDPA."""
    model = load_model(tiny_dir)
    model.setup_cache(1, 256)
    monkeypatch.setattr(runner, "PREFILL_CHUNK", 32)
    calls, forward = [], model.forward

    def spy(tokens, *a, exact=None, **kw):
        calls.append((tokens.shape[1], exact))
        return forward(tokens, *a, exact=exact, **kw)
    monkeypatch.setattr(model, "forward", spy)
    with torch.inference_mode():
        run_ragged(model, [list(range(3, 103))], [0], [0], [1], prompt_lens=[70])
        run_ragged(model, [list(range(3, 67))], [0], [0], [1], prompt_lens=[150])  # a part: [0, 64) of 150
        run_ragged(model, [list(range(3, 67))], [0], [0], [1], prompt_lens=[64])  # the whole prompt
    assert calls == [(32, False), (32, False), (32, None), (4, None),  # [64, 96) holds the prompt's last token
                     (32, False), (32, False), (32, False), (32, None)]


def test_slot_table_sync_keeps_agreeing_prefix():
    t = SlotTable(2, 64)
    st = t.sync(7, 0, [1, 2, 3])
    st.tokens += [4, 5]  # tentative drafts
    st.cached = 5
    st = t.sync(7, 3, [4, 9])  # first draft confirmed, second replaced
    assert st.tokens == [1, 2, 3, 4, 9] and st.cached == 4
    assert t.sync(8, 5, [1]) is None  # unknown sequence at a nonzero offset
    t.release(7)
    assert t.num_free == 2


def test_a_full_slot_table_takes_back_only_an_idle_slot():
    """A full table frees the least recently used slot once no round has touched it for
    evict_idle_s (a sequence no router sends any more), never a slot in use."""
    import time

    from specdec.runner import CacheFullError
    evicted = []
    t = SlotTable(2, 64, evict_idle_s=30, on_evict=evicted.append)
    t.sync(1, 0, [1, 2])
    t.sync(2, 0, [3])
    with pytest.raises(CacheFullError):
        t.sync(3, 0, [4])  # both in use
    t[1].used -= 31
    t.sync(1, 2, [5])  # a round touches it again: in use
    t[2].used -= 31
    assert t.sync(3, 0, [4]).slot == 1  # 2 was idle: its slot is 3's now
    assert evicted == [2] and t.sync(2, 1, [6]) is None  # 2 is unknown: its router re-prefills it
    t[1].used -= 31
    assert t.active() == 1  # 3; 1 is idle: not load (autoscaling's active sequences)


def test_freed_slots_go_to_the_sequences_that_waited_first(monkeypatch):
    """First come, first served: a sequence refused for want of a slot waits in line, and a freed
    slot is the oldest waiter's, not the next caller's (a router whose round frees its finished rows
    and starts its new ones in one call took back every slot it freed, and another router's rows
    waited for its whole queue). A waiter nobody resends gives up its place."""
    from specdec import runner
    from specdec.runner import CacheFullError
    t = SlotTable(1, 64)
    t.sync(1, 0, [1])
    for waiter in (2, 3):
        with pytest.raises(CacheFullError):
            t.sync(waiter, 0, [2])
    t.release(1)
    for newcomer in (4, 3):  # the slot is 2's: neither a newcomer nor a later waiter takes it
        with pytest.raises(CacheFullError):
            t.sync(newcomer, 0, [4])
    assert t.sync(2, 0, [2]).slot == 0 and list(t.waiting) == [3, 4]
    t.release(3)  # (its client left while it waited: out of line)
    t.release(2)
    assert t.sync(4, 0, [4]).slot == 0 and not t.waiting
    t.release(4)
    with pytest.raises(CacheFullError):
        t.sync(5, 0, [5]) if t.sync(6, 0, [6]) else None  # 6 takes the slot, 5 waits
    monkeypatch.setattr(runner, "WAITER_FORGET_S", 0.0)  # 5's router stopped resending it
    t.release(6)
    assert t.sync(7, 0, [7]).slot == 0


def test_missing_model_fails_clearly(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf"):
        resolve(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve(tmp_path / "weights.bin")
    # a GGUF download that ships a config.json beside its one .gguf file (and no other weights) is GGUF
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "config.json").write_text("{}")
    (gguf / "model-q8.gguf").write_bytes(b"GGUF")
    assert resolve(gguf).gguf_file == "model-q8.gguf"
    (gguf / "model.safetensors").write_bytes(b"")  # weights beside it: the checkpoint directory
    assert resolve(gguf).gguf_file is None


def test_a_failed_gguf_conversion_leaves_nothing_in_the_cache(tmp_path, tiny_dir, monkeypatch):
    """A conversion that dies while saving (disk full) must not leave a half-written copy behind
    (the demo's is ~0.5 GB); the next start converts again. transformers' GGUF reader is stubbed."""
    import transformers
    from specdec import envs, loader
    monkeypatch.setattr(envs, "CACHE_DIR", str(tmp_path / "cache"))
    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda path, gguf_file=None, **kw: real_model(tiny_dir, **kw))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, gguf_file=None, **kw: real_tok(tiny_dir))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" * 64)

    def disk_full(*a, **kw):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", disk_full)
        with pytest.raises(OSError, match="No space"):
            loader.materialize(resolve(gguf))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    out = loader.materialize(resolve(gguf))
    assert (out.path / "config.json").is_file() and [p.name for p in out.path.parent.iterdir()] == [out.path.name]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_llama_families_match_transformers(family, tmp_path):
    """Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) and Mistral checkpoints load and match transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(family, vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    model.setup_cache(1, 64)
    ids = [5, 17, 42, 99, 3, 250, 7]
    with torch.inference_mode():
        logits, _ = model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), n_logits=len(ids))
        ref = hf.eval()(torch.tensor([ids])).logits[0]
    assert torch.allclose(logits[0], ref, atol=1e-4)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("T", [1, 3])
def test_grouped_attention_matches_sdpa(heads, kv_heads, T):
    """The position-invariant attention is attention: it matches SDPA (float32) with GQA, with and
    without grouping, for one query and several, over a causal mask."""
    import torch.nn.functional as F
    from specdec.model import grouped_attention
    torch.manual_seed(0)
    B, L, D = 2, 9, 8
    q, k, v = torch.randn(B, heads, T, D), torch.randn(B, kv_heads, L, D), torch.randn(B, kv_heads, L, D)
    pos = torch.tensor([[L - T + t for t in range(T)]] * B)
    mask = (torch.arange(L)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, L]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    assert torch.allclose(grouped_attention(q, k, v, mask), ref, atol=1e-5)


def _logits_by_chunks(model, ids, start, chunk, batch=1):
    model.setup_cache(batch, len(ids) + 8)
    slots = torch.arange(batch)
    with torch.inference_mode():
        model(torch.tensor([ids[:start]] * batch), slots, torch.zeros(batch, dtype=torch.long))
        out = []
        for c in range(start, len(ids), chunk):
            toks = ids[c: c + chunk]
            lg, _ = model(torch.tensor([toks] * batch), slots, torch.full((batch,), c), n_logits=len(toks))
            out.append(lg[0])
    return torch.cat(out)


def test_attention_row_does_not_depend_on_masked_keys_after_it():
    """A query's position-invariant attention is bit-identical however many masked keys follow
    its last one: a plain step reads fewer keys than a verification of the same position, or than
    the longest row of a ragged batch. One float32 matmul over all keys changed the weighted sum in
    its last bit for ~5% of rows at 150-420 keys on this CPU, which flipped bf16 near-ties (greedy
    speculative output left plain decoding's at 256 tokens)."""
    from specdec.model import grouped_attention
    torch.manual_seed(0)
    for L in range(150, 420, 9):
        q = torch.randn(1, 9, 1, 64).bfloat16()
        k, v = torch.randn(2, 1, 3, L + 100, 64).bfloat16()
        outs = []
        for extra in (0, 1, 2, 3, 5, 8, 40, 64, 100):
            mask = torch.zeros(1, 1, 1, L + extra, dtype=torch.bool)
            mask[..., :L] = True
            outs.append(grouped_attention(q, k[:, :, :L + extra], v[:, :, :L + extra], mask))
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), L


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_do_not_depend_on_positions_per_forward(demo_dir, dtype):
    """With position_invariant (the default on CPU, bfloat16 and float32): a position's logits are
    bit-identical whether it is computed alone, 2, 4 or 8 positions per forward, at batch 1 or 3;
    without it (SDPA, one-row matmuls) they differ, which is what flipped near-ties under
    speculation (bf16: often; float32: a tie of 1.2e-6 in a tiny model's greedy answer)."""
    model = load_model(demo_dir, dtype=dtype)
    try:
        assert model.position_invariant
        ids = list(range(1000, 1040))
        ref = _logits_by_chunks(model, ids, 24, 1)
        for chunk, batch in [(2, 1), (4, 1), (8, 1), (4, 3), (1, 3)]:
            assert torch.equal(_logits_by_chunks(model, ids, 24, chunk, batch), ref), (chunk, batch)
        long = [(1000 + 37 * i) % 40000 for i in range(300)]  # past 256 keys, where it once broke
        ref = _logits_by_chunks(model, long, 276, 1)
        for chunk, batch in [(3, 1), (4, 1), (8, 1), (4, 3)]:
            assert torch.equal(_logits_by_chunks(model, long, 276, chunk, batch), ref), ("long", chunk, batch)
        model.exact_positions = False
        assert any(not torch.equal(_logits_by_chunks(model, ids, 24, c), _logits_by_chunks(model, ids, 24, 1))
                   for c in (2, 4, 8))
    finally:
        model.exact_positions = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projections_are_bit_identical(tiny_dir, dtype):
    """setup_cache fuses q/k/v and gate/up into one matmul each (`FusedLinear`): the logits are
    bit-identical to the separate layers' in ragged batches of 1 to 5 new tokens per row; the state
    dict keeps the separate names; in-place weight loads reach the fused weight; training reads the
    separate layers (their gradients)."""
    fused, separate = load_model(tiny_dir, dtype=dtype), load_model(tiny_dir, dtype=dtype)
    fused.setup_cache(3, 64)
    separate.setup_cache(3, 64)
    for layer in separate.layers:  # the separate layers run where nothing is fused
        layer.self_attn.qkv.weight = layer.mlp.gate_up.weight = None
    assert fused.layers[0].self_attn.qkv.weight is not None
    assert fused.state_dict().keys() == separate.state_dict().keys()
    assert not any(".qkv." in k or ".gate_up." in k for k in fused.state_dict())
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    with torch.inference_mode():
        for model in (fused, separate):
            for s, p in enumerate(prompts):
                run_ragged(model, [p], [s], [0], [1])
        for n in range(1, 6):
            feeds = [[20 + n + r] * ((n + r) % 5 + 1) for r in range(3)]
            starts = [len(p) + 5 * (n - 1) for p in prompts]
            args = (feeds, [0, 1, 2], starts, [len(f) for f in feeds])
            for a, b in zip(run_ragged(fused, *args), run_ragged(separate, *args)):
                assert torch.equal(a, b)
    with torch.no_grad():  # an in-place load after fusing reaches the fused weight
        attn = fused.layers[0].self_attn
        attn.k_proj.weight.mul_(2)
        q, k, v = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]
        assert torch.equal(attn.qkv.weight[q: q + k], attn.k_proj.weight)
    fused.train()
    x = torch.randn(1, 2, fused.args.hidden_size, dtype=dtype)
    fused.layers[0].mlp(x).sum().backward()
    assert fused.layers[0].mlp.gate_proj.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_follow_the_weights_and_keep_rows_invariant(tiny_dir, dtype, monkeypatch):
    """CPU inference multiplies with oneDNN's prepacked weights (`PackedWeight`): the logits agree
    with plain F.linear's, a row's logits do not depend on how many rows share the matmul (1-8), an
    in-place load or a new weight reaches the packed copy, and autograd runs F.linear."""
    from specdec import model as model_mod

    if not model_mod._PACKABLE.get(dtype):
        pytest.skip(f"this torch build cannot prepack {dtype} weights")
    packable = dict(model_mod._PACKABLE)
    model = load_model(tiny_dir, dtype=dtype)
    model.setup_cache(8, 64)
    head = model.lm_head

    def logits(packed: bool) -> torch.Tensor:
        monkeypatch.setattr(model_mod, "_PACKABLE", packable if packed else {})
        with torch.inference_mode():
            return run_ragged(model, [[3, 4, 5, 6, 7]], [0], [0], [5])[0]

    assert head.packed.weight is None
    unpacked = logits(False)
    assert head.packed.weight is None  # switched off: F.linear, no copy
    packed = logits(True)
    assert head.packed.weight is not None and model.layers[0].self_attn.qkv.packed.weight is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(packed, unpacked, atol=tol, rtol=0)

    x = torch.randn(8, head.in_features, dtype=dtype)
    with torch.inference_mode():
        rows = [head(x[:n]) for n in range(1, 9)]
    assert all(torch.equal(r, rows[-1][: len(r)]) for r in rows)

    with torch.no_grad():  # an in-place load: the packed copy follows (version counter)
        head.weight.mul_(2)
        model.layers[0].mlp.up_proj.weight.add_(0.5)
    assert torch.allclose(logits(True), logits(False), atol=2 * tol, rtol=0)
    assert not torch.allclose(logits(True), packed, atol=2 * tol, rtol=0)
    head.weight = torch.nn.Parameter(head.weight.detach() * 0.5)  # a new weight (as tensor parallelism shards)
    assert torch.allclose(logits(True), logits(False), atol=tol, rtol=0)

    monkeypatch.setattr(model_mod, "_PACKABLE", packable)
    w = torch.nn.Parameter(head.weight.detach().clone())
    head.weight = w
    head(torch.randn(2, head.in_features, dtype=dtype)).sum().backward()  # autograd: F.linear
    assert w.grad is not None


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_linear_rows_do_not_depend_on_rows_per_call(packed, threads, monkeypatch):
    """A bf16 linear row (the demo target's MLP and draft head widths) is bit-identical however many rows
    share the call, from 1 up to 3 x LINEAR_ROWS, batched or as one row's positions: on a Xeon with AMX,
    oneDNN's kernels change at 33 rows, which made a verification of 8 rows x 5 positions differ from
    plain steps (bench/linear_rows.py)."""
    from specdec import model as model_mod
    from specdec.model import LINEAR_ROWS, Linear

    if not packed:
        monkeypatch.setattr(model_mod, "_PACKABLE", {})
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    try:
        for out_features in (3072, 8192):
            lin = Linear(576, out_features, bias=False, dtype=torch.bfloat16)
            x = torch.randn(3 * LINEAR_ROWS, 1, 576, dtype=torch.bfloat16)  # rows of one position each
            with torch.inference_mode():
                alone = torch.cat([lin(x[i: i + 1]) for i in range(len(x))])
                for m in (2, 8, LINEAR_ROWS, LINEAR_ROWS + 1, 40, 2 * LINEAR_ROWS + 5, 3 * LINEAR_ROWS):
                    together = torch.cat([lin(x[i: i + m]) for i in range(0, len(x), m)])
                    assert torch.equal(together, alone), (out_features, m)
                assert torch.equal(lin(x.view(8, -1, 576)).view(len(x), 1, -1), alone)  # 8 rows x 12 positions
                assert torch.equal(lin(x.view(1, -1, 576)).view(len(x), 1, -1), alone)  # one row's 96 positions
    finally:
        torch.set_num_threads(saved)


def test_sync_keeps_cached_positions_only_up_to_the_first_replaced_token():
    t = SlotTable(2, 64)
    st = t.sync(7, 0, [1, 2])
    st.tokens += [3, 4]  # a proposer's tentative drafts after the confirmed tokens
    st.cached = 4  # their keys/values were written
    st = t.sync(7, 2, [3, 9, 5])  # the first draft accepted, the second replaced
    assert st.tokens == [1, 2, 3, 9, 5]
    assert st.cached == 3  # position 3 held the rejected draft's keys: no longer valid
    st = t.sync(7, 5, [6])  # nothing replaced: the cache stays
    assert st.cached == 3


def test_a_slot_taken_back_from_an_idle_sequence_tells_its_owner():
    evicted = []
    t = SlotTable(1, 64, evict_idle_s=0.01, on_evict=evicted.append)
    t.sync(1, 0, [1, 2])
    time.sleep(0.02)
    st = t.sync(2, 0, [3])
    assert st is not None and 1 not in t and evicted == [1]
    assert t.evicted == 1


def test_a_directory_of_several_ggufs_asks_which(tmp_path):
    """A directory with one GGUF per quantization: the user names one, none is picked silently."""
    for name in ("model-q4_k_m.gguf", "model-q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"several \.gguf files .*name one"):
        resolve(tmp_path)
    assert resolve(tmp_path / "model-q8_0.gguf").gguf_file == "model-q8_0.gguf"  # naming one loads it


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "model.pt"])
def test_a_file_that_is_not_a_gguf_is_refused_by_name(tmp_path, name):
    """A checkpoint's file passed instead of its directory is refused clearly, not read as a GGUF."""
    (tmp_path / name).write_bytes(b"{}")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve(tmp_path / name)


def test_aligned_key_reads_span_at_least_two_chunks():
    """Chunk-aligned key reads (compiled targets) span at least two chunks, the extra keys masked, so
    a short sequence runs the graph the warm-up compiled."""
    from specdec.model import ATTN_KEYS, BatchIndex
    one = torch.zeros(1, dtype=torch.long)
    for start, T in [(0, 1), (3, 5), (ATTN_KEYS - 2, 1)]:  # fits in one chunk: still reads two
        rows = BatchIndex.build(one, torch.tensor([start]), T, exact=True, align=ATTN_KEYS)
        assert rows.kv_len == 2 * ATTN_KEYS and rows.mask.shape[-1] == 2 * ATTN_KEYS
        assert not rows.mask[..., start + T:].any()  # the extra keys are masked
    rows = BatchIndex.build(one, torch.tensor([2 * ATTN_KEYS]), 4, exact=True, align=ATTN_KEYS)
    assert rows.kv_len == 3 * ATTN_KEYS  # longer reads round up to whole chunks
    assert BatchIndex.build(one, torch.tensor([3]), 5).kv_len == 8  # unaligned: exactly start + T
