"""AppArgs: max_model_len defaults to the target's own limit, capped by the KV-cache budget; the
lookup corpus defaults to the demo target's and is checked against the target."""
from __future__ import annotations

from pathlib import Path

import pytest

from serve_app.args import AppArgs


@pytest.fixture(scope="module")
def short_dir(tmp_path_factory):
    """A target with fewer positions (512) than the old fixed default (2048)."""
    from tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("short"), seed=0, layers=2, max_pos=512)


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("long"), seed=0, layers=2, max_pos=100_000)


def _resolved(**kw) -> AppArgs:
    a = AppArgs(proposer="ngram", **kw)
    a.validate_models()
    return a


def test_default_is_the_models_own_limit(short_dir):
    a = _resolved(target=str(short_dir))  # before: refused to start (2048 > 512 positions)
    assert a.max_model_len == 512
    assert a.target_config().max_model_len == a.router_config().max_model_len == a.draft_config().max_model_len == 512


def test_default_is_capped_by_the_cache_budget(long_dir):
    # tiny target: 2 layers x (k, v) x 2 kv heads x 16 head dims = 128 values per token per slot
    # (each slot's cache also holds KV_MARGIN = 144 positions past max_model_len)
    budget = 2**21  # 2 MiB for 8 x 2 = 16 slots
    f32 = _resolved(target=str(long_dir), kv_cache_memory_gib=budget / 2**30, dtype="float32")
    assert f32.max_model_len == (budget // (128 * 4 * 16) - 144) // 16 * 16 == 112
    bf16 = _resolved(target=str(long_dir), kv_cache_memory_gib=budget / 2**30, dtype="bfloat16")
    assert bf16.max_model_len == 368  # half the bytes per token: twice the positions, less the margin
    fewer_slots = _resolved(target=str(long_dir), kv_cache_memory_gib=budget / 2**30, max_batch_size=2,
                            lanes_per_target=1, dtype="float32")
    assert fewer_slots.max_model_len == 1904
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        _resolved(target=str(long_dir), kv_cache_memory_gib=1e-6)


def test_explicit_value_is_kept_and_checked(short_dir):
    assert _resolved(target=str(short_dir), max_model_len=256).max_model_len == 256
    with pytest.raises(ValueError, match="max_model_len=1024 exceeds the target's 512 positions"):
        _resolved(target=str(short_dir), max_model_len=1024)


def test_configs_need_the_resolved_value(short_dir):
    with pytest.raises(ValueError, match="validate_models"):
        AppArgs(target=str(short_dir), proposer="ngram").target_config()


@pytest.mark.parametrize("flags, device, expected", [
    ("fpu sse avx512f avx512_bf16 avx512_vnni", "cpu", "bfloat16"),
    ("fpu sse avx512f amx_bf16 amx_tile", "cpu", "bfloat16"),
    ("fpu sse avx2 avx512f avx512_vnni", "cpu", "float32"),  # oneDNN would emulate bf16: slower
    ("fpu sse avx512f avx512_bf16", "cuda", "float32"),  # GPU GEMMs are not row-count invariant
])
def test_auto_dtype_is_bfloat16_where_it_is_native_and_lossless(monkeypatch, tmp_path, flags, device, expected):
    import builtins
    from specdec import loader
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(cpuinfo if f == "/proc/cpuinfo" else f, *a, **k))
    assert loader.fast_dtype(device) == expected
    a = AppArgs(proposer="ngram", device=device)  # dtype defaults to "auto"
    assert a.dtype == expected
    assert AppArgs(proposer="ngram", device=device, dtype="float32").dtype == "float32"  # an explicit choice stays


def test_the_target_returns_the_taps_a_fusing_draft_reads(tiny_dir, tiny_eagle_dir):
    """An EAGLE-3 draft (feature_layers in its config.json) makes the target replicas tap those layers."""
    a = AppArgs(target=str(tiny_dir), proposer="hybrid", draft=str(tiny_eagle_dir))
    a.validate_models()
    cfg = a.target_config()
    assert cfg.return_hidden and cfg.feature_layers == [0]
    off = AppArgs(target=str(tiny_dir), proposer="hybrid", draft=str(tiny_eagle_dir), num_speculative_tokens=0)
    off.validate_models()
    assert off.target_config().feature_layers == []


def test_lookup_corpus_auto_is_the_demo_targets_and_is_checked(tiny_dir, tmp_path):
    from specdec.corpus import NgramCorpus
    assert AppArgs().lookup_corpus == "smollm2-corpus"  # shipped for the demo target
    assert AppArgs(target=str(tiny_dir)).lookup_corpus is None  # no corpus for other targets
    assert AppArgs(lookup_corpus="none").lookup_corpus is None
    # lookups in whole lanes with a corpus; prompt lookup alone only pays in small rounds
    assert (AppArgs().lookup_max_batch, AppArgs().lookup_k) == (8, 2)
    assert (AppArgs(target=str(tiny_dir)).lookup_max_batch, AppArgs(target=str(tiny_dir)).lookup_k) == (4, 4)
    assert AppArgs(target=str(tiny_dir), lookup_max_batch=8, lookup_k=3).model_dump(
        include={"lookup_max_batch", "lookup_k"}) == {"lookup_max_batch": 8, "lookup_k": 3}  # set by the user: kept
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(tiny_dir).vocab_size
    ok, big = tmp_path / "ok.npz", tmp_path / "big.npz"
    NgramCorpus.save(ok, [[1, 2, 3]], vocab)
    NgramCorpus.save(big, [[1, 2, 3]], vocab + 1)
    a = AppArgs(target=str(tiny_dir), lookup_corpus=str(ok))
    a.validate_models()
    assert a.target_config().lookup_corpus == str(ok)
    with pytest.raises(ValueError, match="vocabulary"):
        AppArgs(target=str(tiny_dir), lookup_corpus=str(big)).validate_models()
    with pytest.raises(ValueError, match="does not exist"):
        AppArgs(target=str(tiny_dir), lookup_corpus=str(tmp_path / "missing.npz")).validate_models()


def test_compile_reaches_the_target_and_needs_one_cpu_rank(short_dir):
    assert _resolved(target=str(short_dir), lookup_corpus=None, compile=True).target_config().compile
    assert not _resolved(target=str(short_dir), lookup_corpus=None).target_config().compile
    with pytest.raises(ValueError, match="compile needs tp=1"):
        _resolved(target=str(short_dir), lookup_corpus=None, compile=True, tp=2).target_config()


def test_autoscaling_capacities_follow_the_apps_own_sizes(short_dir):
    """A Target replica holds max_batch_size x lanes_per_target sequences and a Router its lanes'
    rows: the policies measure load against those, not against fixed defaults (a 64-slot Target
    at a quarter of its slots was scaled out); a user's autoscaling_policy_kwargs still win."""
    from serve_app.builder import _scaling
    a = _resolved(target=str(short_dir), autoscaling=True, max_batch_size=4, lanes_per_target=3,
                  max_target_replicas=2)
    kwargs = _scaling(a, "Target", 1, 2)["autoscaling_config"].policy.policy_kwargs
    assert kwargs["target_sequences_per_replica"] == 12 and kwargs["router_ongoing_per_replica"] == 24
    b = _resolved(target=str(short_dir), autoscaling=True, autoscaling_policy_kwargs={"target_sequences_per_replica": 5})
    assert _scaling(b, "Target", 1, 2)["autoscaling_config"].policy.policy_kwargs["target_sequences_per_replica"] == 5


def test_command_line_strings_parse(short_dir):
    """`serve run serve_app:build_app key=value` passes strings: JSON for nested fields, "none"
    for no tracing, and no infinite values (a lane waiting "inf" seconds never runs)."""
    a = AppArgs(target=str(short_dir), proposer="ngram", autoscaling="true",
                autoscaling_policy_kwargs='{"target_tokens_per_s": 50}', tracing="none")
    assert a.autoscaling_policy_kwargs == {"target_tokens_per_s": 50.0} and a.tracing.exporter == "none"
    assert a.tracing_env()["SPECDEC_TRACING_EXPORTER"] == "none"  # (None would read the environment's OTel settings)
    for bad in ({"batch_wait_timeout_s": "inf"}, {"kv_cache_memory_gib": "inf"}):
        with pytest.raises(ValueError):
            AppArgs(target=str(short_dir), proposer="ngram", **bad)


def test_every_deployments_config_carries_the_apps_tracing(short_dir):
    """Explicit tracing reaches each replica (and the TP workers, through the Target's config) in its
    config: a Serve config's ray_actor_options replace the whole runtime_env, and k8s/rayservice.yaml
    overrides the Router's and the Draft's, which then traced nothing."""
    from serve_app.builder import _actor_options
    a = _resolved(target=str(short_dir), tracing={"exporter": "otlp", "otlp_endpoint": "http://c:4318/v1/traces",
                                                  "sampling_ratio": 0.1})
    env = a.tracing_env()
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.1" and env["SPECDEC_TRACING_EXPORTER"] == "otlp"
    for cfg in (a.router_config(), a.target_config(), a.draft_config()):
        assert cfg.tracing_env == env, type(cfg).__name__
    assert a.router_config().target_build == a.target_config().build_key()  # (the rounds' build: test_faults)
    assert not set(env) & set(_actor_options(a, 1.0)["runtime_env"]["env_vars"])  # (not where an override drops it)


def test_the_router_is_built_with_an_empty_user_config(short_dir):
    """With user_config {} in the code, removing a config file's user_config hands {} (the built
    values) to the running Routers too; with None, Serve left them as the removed block had set them."""
    from ray.serve._private.build_app import build_app as serve_build

    from serve_app.builder import build_app
    built = serve_build(build_app({"target": str(short_dir), "proposer": "ngram"}), name="x")
    assert {d.name: d.user_config for d in built.deployments}["Router"] == {}


def test_lanes_cover_every_initial_target_replica(short_dir):
    a = AppArgs(target=str(short_dir), proposer="ngram", autoscaling=True, target_replicas=4, max_target_replicas=1)
    assert a.total_lanes == 4 * a.lanes_per_target  # not 1 target's lanes over 4 replicas


def test_every_replicas_cache_fits_the_budget(long_dir, tiny_draft_dir, tiny_dir, tiny_eagle_dir):
    # a Draft replica holds every lane's rows: 8 target replicas x 2 lanes x 8 rows = 128 slots
    many = dict(target_replicas=8, kv_cache_memory_gib=2**24 / 2**30, dtype="float32")
    selfd = AppArgs(target=str(long_dir), proposer="self", self_draft_layers=1, **many)
    selfd.validate_models()  # draft: 128 slots x 1 layer (256 B); target: 16 slots x 2 layers (512 B)
    assert selfd.max_model_len == (2**24 // (256 * 128) - 144) // 16 * 16 == 368  # target alone: 1904
    explicit = AppArgs(target=str(long_dir), proposer="draft", draft=str(tiny_draft_dir), max_model_len=256,
                       **{**many, "kv_cache_memory_gib": 5e6 / 2**30})  # target 3.3 MB, draft 128 x 128 B x 400: 6.6 MB
    with pytest.raises(ValueError, match="KV cache of a draft replica"):
        explicit.validate_models()
    # the in-target copy of an EAGLE draft (1 layer, 256 B per position) shares the target's budget
    budget = dict(kv_cache_memory_gib=2**22 / 2**30, dtype="float32")
    with_copy = AppArgs(target=str(tiny_dir), proposer="hybrid", draft=str(tiny_eagle_dir), **budget)
    with_copy.validate_models()
    assert with_copy.target_config().draft_in_target and with_copy.max_model_len == 192  # 16 x 768 B per position
    without = AppArgs(target=str(tiny_dir), proposer="hybrid", draft=str(tiny_eagle_dir), draft_in_target=False, **budget)
    without.validate_models()
    assert without.max_model_len == 368


def test_a_local_directory_named_like_the_demo_target_is_the_users(tiny_dir, tmp_path, monkeypatch):
    """As in transformers' from_pretrained, a path that exists wins over a name: a checkpoint saved
    as ./smollm2 is loaded, without the demo target's draft and corpus, and replicas (whose working
    directory differs) get its absolute path."""
    import shutil

    from specdec.loader import resolve
    shutil.copytree(tiny_dir, tmp_path / "smollm2")
    monkeypatch.chdir(tmp_path)
    assert resolve("smollm2").path == Path("smollm2")
    a = AppArgs(target="smollm2")
    assert a.target == str((tmp_path / "smollm2").resolve())
    assert (a.draft, a.proposer, a.lookup_corpus, a.served_model_name) == (None, "ngram", None, "smollm2")
    a.validate_models()
    monkeypatch.chdir(tmp_path / "smollm2")  # no such path here: the name is the demo target's
    assert (AppArgs().target, AppArgs().draft, AppArgs().served_model_name) == (
        "smollm2", "smollm2-eagle", "SmolLM2-135M-Instruct")
