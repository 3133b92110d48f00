"""Static checks of the Kubernetes manifests in k8s/ (fast: no cluster, no network, no Ray).

* RayService/RayCluster documents validate against the real KubeRay CRD schemas copied to
  ``<repo>/../shared/kuberay`` (or ``$SPECDEC_SHARED_DIR/kuberay``): jsonschema on
  ``spec.versions[name=v1].schema.openAPIV3Schema``, plus a strict pass that flags fields the
  schema does not know (the API server would silently prune them).
* ``serveConfigV2`` validates against Ray Serve's own ``ServeDeploySchema``; its import paths and
  autoscaling policy functions import; each application's args validate as ``AppArgs``.
* The replicas fit the worker groups, computed the way the Ray autoscaler reads a RayCluster.
* The PodMonitor scrapes ports the pods declare; the Grafana ConfigMap matches its generator.
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import math
import os
import re
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from shared_files import missing_resource

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
SHARED = Path(os.environ.get("SPECDEC_SHARED_DIR") or ROOT.parent / "shared")
KUBERAY = SHARED / "kuberay"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
KNOWN_KINDS = {("ray.io/v1", "RayService"), ("ray.io/v1", "RayCluster"),
               ("monitoring.coreos.com/v1", "PodMonitor"), ("v1", "ConfigMap")}
SPECDEC_DEPLOYMENTS = {"Router", "Draft", "Target"}

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ----------------------------------------------------------------------------- loading

def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.y*ml") if p.suffix in (".yaml", ".yml"))


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.load_all(path.read_text(encoding="utf-8"), Loader=_Loader) if d is not None]


def _all_docs() -> list[tuple[str, dict]]:
    return [(f"{p.name}#{i}", d) for p in _manifest_files() for i, d in enumerate(_docs(p))]


def _rayservices() -> list[tuple[str, dict]]:
    return [(name, d) for name, d in _all_docs() if d.get("kind") == "RayService"]


RAYSERVICES = _rayservices()
RS_IDS = [name for name, _ in RAYSERVICES]


@lru_cache(maxsize=None)
def _crd_schema(kind: str) -> dict:
    path = KUBERAY / CRD_FILES[kind]
    if not path.is_file():
        missing_resource(f"KubeRay CRDs not found at {KUBERAY} (set SPECDEC_SHARED_DIR)")
    crd = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    assert crd["spec"]["names"]["kind"] == kind, f"{path.name} is not the {kind} CRD"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"], f"{kind} v1 is not served by this CRD"
    return crd["spec"]["group"], v1["schema"]["openAPIV3Schema"]


def _schema_errors(doc: dict) -> list[str]:
    """jsonschema errors + fields unknown to the CRD, for a ray.io document."""
    from jsonschema import Draft7Validator

    group, schema = _crd_schema(doc["kind"])
    assert doc["apiVersion"] == f"{group}/v1", f"apiVersion {doc['apiVersion']!r} != {group}/v1"
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in Draft7Validator(schema).iter_errors(doc)]
    errors += [f"{p}: field not in the CRD schema (the API server would drop it)"
               for p in _unknown_fields(doc, schema, "")]
    return errors


def _unknown_fields(value, schema: dict, path: str):
    """Paths of object keys that the structural schema does not declare."""
    if not isinstance(schema, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        for k, v in value.items():
            if props is not None and k in props:
                yield from _unknown_fields(v, props[k], f"{path}/{k}")
            elif isinstance(addl, dict):
                yield from _unknown_fields(v, addl, f"{path}/{k}")
            elif props is not None and addl is not True:
                yield f"{path}/{k}"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            yield from _unknown_fields(v, schema["items"], f"{path}/{i}")


def _serve_config(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def _cluster(rs: dict) -> dict:
    return rs["spec"]["rayClusterConfig"]


def _groups(rs: dict):
    """(name, group spec, is_head) for the head and every worker group."""
    rc = _cluster(rs)
    yield "head", rc["headGroupSpec"], True
    for g in rc.get("workerGroupSpecs", []):
        yield g["groupName"], g, False


def _containers(rs: dict):
    for gname, g, is_head in _groups(rs):
        for c in g["template"]["spec"].get("containers", []):
            yield gname, g, is_head, c


def _ray_resources(group: dict, is_head: bool) -> dict[str, float]:
    """A group's Ray resources per pod, as the Ray autoscaler computes them for scaling."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec
    return {k: float(v) for k, v in _get_ray_resources_from_group_spec(group, is_head).items()}


_SUFFIX = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _quantity(q) -> float:
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(q).strip())
    assert m and (not m.group(2) or m.group(2) in _SUFFIX), f"bad quantity {q!r}"
    return float(m.group(1)) * _SUFFIX.get(m.group(2), 1)


def _actor_options(app: dict, d: dict) -> dict:
    """A Router's or Draft's ray_actor_options: the config's override, else the code's num_cpus."""
    if "ray_actor_options" in d:
        return d["ray_actor_options"]
    args = _app_args_cls()(**app["args"])
    return {"num_cpus": getattr(args, {"Router": "router_cpus", "Draft": "draft_cpus"}[d["name"]])}


def _app_args_cls():
    from serve_app.args import AppArgs  # provided by the lead's serve_app package
    return AppArgs


def _constraint_pin(name: str) -> str | None:
    path = ROOT / "docker" / "constraints.txt"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        m = re.fullmatch(rf"{re.escape(name)}==([^\s;#]+).*", line.strip())
        if m:
            return m.group(1)
    return None


# ----------------------------------------------------------------------------- manifests

def test_manifests_exist_and_parse():
    names = {p.name for p in _manifest_files()}
    assert {"rayservice.yaml", "rayservice-cpu.yaml", "podmonitor.yaml"} <= names, names
    for name, doc in _all_docs():
        assert isinstance(doc, dict), name
        assert (doc.get("apiVersion"), doc.get("kind")) in KNOWN_KINDS, \
            f"{name}: {doc.get('apiVersion')} {doc.get('kind')} has no check in this test"
        assert doc.get("metadata", {}).get("name"), f"{name}: metadata.name missing"


@pytest.mark.parametrize("name,doc", [(n, d) for n, d in _all_docs() if d.get("apiVersion", "").startswith("ray.io/")],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_kuberay_documents_validate_against_crd(name, doc):
    assert doc["kind"] in CRD_FILES, f"{name}: no KubeRay CRD for kind {doc['kind']}"
    errors = _schema_errors(doc)
    assert not errors, f"{name}:\n" + "\n".join(errors)


def test_crd_validation_is_not_vacuous():
    """The validator rejects a missing required field and a misspelled one."""
    assert RAYSERVICES, "no RayService in k8s/"
    doc = copy.deepcopy(RAYSERVICES[0][1])
    del doc["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert any("headGroupSpec" in e for e in _schema_errors(doc))
    doc = copy.deepcopy(RAYSERVICES[0][1])
    doc["spec"]["rayClusterConfig"]["enableInTreeAutoScaling"] = True
    assert any("enableInTreeAutoScaling" in e for e in _schema_errors(doc))
    doc = copy.deepcopy(RAYSERVICES[0][1])
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "four"
    assert _schema_errors(doc)


def test_both_rayservices_present():
    by_file = {name.split("#")[0] for name in RS_IDS}
    assert by_file == {"rayservice.yaml", "rayservice-cpu.yaml"}, by_file


@pytest.mark.parametrize("name,rs", RAYSERVICES, ids=RS_IDS)
def test_cluster_shape(name, rs):
    rc = _cluster(rs)
    assert rc.get("enableInTreeAutoscaling") is True, "Serve's replica decisions must add/remove pods"
    assert rc["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0", "the head must do no model work"
    assert rc.get("workerGroupSpecs"), "no worker groups"
    ray_pin = _constraint_pin("ray")
    if ray_pin:
        assert rc["rayVersion"] == ray_pin, f"rayVersion {rc['rayVersion']} != image's ray {ray_pin}"
    images = {c["image"] for _, _, _, c in _containers(rs)}
    assert len(images) == 1, f"Ray containers use different images: {images}"
    (image,) = images
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"pin the image tag: {image}"
    for g in rc["workerGroupSpecs"]:
        assert 0 <= g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"], g["groupName"]


@pytest.mark.parametrize("name,rs", RAYSERVICES, ids=RS_IDS)
def test_every_container_has_requests_and_limits(name, rs):
    rc = _cluster(rs)
    containers = [(g, c) for g, _, _, c in _containers(rs)]
    if rc.get("enableInTreeAutoscaling"):
        containers.append(("autoscaler", {"name": "autoscaler", **rc.get("autoscalerOptions", {})}))
    for gname, c in containers:
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                assert r in (res.get(kind) or {}), f"{gname}/{c['name']}: resources.{kind}.{r} missing"
        for r in ("cpu", "memory"):
            assert _quantity(res["requests"][r]) <= _quantity(res["limits"][r]), f"{gname}/{c['name']}: {r}"
        for r, v in (res.get("limits") or {}).items():
            if r.endswith("/gpu"):
                assert str(res.get("requests", {}).get(r, v)) == str(v), \
                    f"{gname}/{c['name']}: extended resource {r} requests must equal limits"


@pytest.mark.parametrize("name,rs", RAYSERVICES, ids=RS_IDS)
def test_auth_mode_is_consistent(name, rs):
    """Ray token auth: either the operator manages it (authOptions) or every container agrees."""
    rc = _cluster(rs)
    mode = (rc.get("authOptions") or {}).get("mode")
    envs = {}
    for gname, _, _, c in _containers(rs):
        envs[f"{gname}/{c['name']}"] = {e["name"]: e.get("value") for e in c.get("env", [])}.get("RAY_AUTH_MODE")
    if rc.get("enableInTreeAutoscaling"):
        envs["autoscaler"] = {e["name"]: e.get("value")
                              for e in (rc.get("autoscalerOptions") or {}).get("env", [])}.get("RAY_AUTH_MODE")
    if mode == "token":
        bad = {k: v for k, v in envs.items() if v not in (None, "token")}
        assert not bad, f"authOptions.mode=token but containers override RAY_AUTH_MODE: {bad}"
    else:
        values = set(envs.values())
        assert len(values) == 1 and None not in values, \
            f"without authOptions token mode, set RAY_AUTH_MODE on every container alike: {envs}"
        if mode is not None:
            assert values == {mode}, f"authOptions.mode={mode} but containers say {values}"


@pytest.mark.parametrize("name,rs", RAYSERVICES, ids=RS_IDS)
def test_worker_probes_keep_serve_readiness(name, rs):
    """KubeRay injects Serve-aware readiness probes on RayService workers; an explicit probe must
    still check Serve's proxy health, or pods get traffic before their proxy is up."""
    for gname, _, is_head, c in _containers(rs):
        probe = c.get("readinessProbe")
        if is_head or not probe:
            continue
        assert "/-/healthz" in json.dumps(probe), f"{gname}: readinessProbe does not check Serve's /-/healthz"


@pytest.mark.parametrize("name,rs", RAYSERVICES, ids=RS_IDS)
def test_ports_declared(name, rs):
    for gname, _, is_head, c in _containers(rs):
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        assert ports.get("serve") == 8000 and ports.get("metrics") == 8080, f"{gname}: {ports}"
        if is_head:
            assert ports.get("dashboard") == 8265, ports


# ----------------------------------------------------------------------------- serveConfigV2

@pytest.mark.parametrize("name,rs", RAYSERVICES, ids=RS_IDS)
def test_serve_config_validates_with_ray_schema(name, rs):
    from ray.serve.schema import ServeDeploySchema

    cfg = _serve_config(rs)
    schema = ServeDeploySchema.model_validate(cfg)
    (app,) = schema.applications
    assert app.name == "specdec" and app.import_path == "serve_app:build_app"
    assert app.route_prefix == "/"
    assert set(app.deployment_names) == SPECDEC_DEPLOYMENTS, app.deployment_names
    assert app.autoscaling_policy and app.autoscaling_policy.get("policy_function"), \
        "application-level autoscaling_policy.policy_function missing"
    for d in app.deployments:
        ac = d.autoscaling_config
        assert isinstance(ac, dict) and ac.get("policy", {}).get("policy_function"), \
            f"{d.name}: autoscaling_config.policy.policy_function missing"


@pytest.mark.parametrize("name,rs", RAYSERVICES, ids=RS_IDS)
def test_serve_http_listens_on_all_interfaces_in_pods(name, rs):
    """serve_config.yaml binds 127.0.0.1 (a laptop default); in a pod the proxy must listen on all
    interfaces, or the Service on the declared serve port reaches nothing."""
    from ray.serve.schema import ServeDeploySchema

    http = ServeDeploySchema.model_validate(_serve_config(rs)).http_options  # absent: Serve's defaults
    assert http.host in ("0.0.0.0", "::"), f"serveConfigV2 http_options.host {http.host!r}: pods need 0.0.0.0"
    ports = {p["containerPort"] for _, _, _, c in _containers(rs) for p in c.get("ports", [])
             if p.get("name") == "serve"}
    assert ports == {http.port}, f"serve containerPort {ports} != http_options.port {http.port}"


def _app_configs():
    return [(f"{name}:{app['name']}", rs, app) for name, rs in RAYSERVICES
            for app in _serve_config(rs)["applications"]]


APPS = _app_configs()
APP_IDS = [a[0] for a in APPS]


@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_import_paths_and_policies_import(name, rs, app):
    from ray._common.utils import import_attr
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    builder = import_attr(app["import_path"])
    assert callable(builder), app["import_path"]
    # Parsing the autoscaling config imports (and pickles) the policy, as Serve does on deploy.
    # Classes: Ray instantiates a class with policy_kwargs and ignores the kwargs of anything else.
    app_policy = AutoscalingPolicy(**app["autoscaling_policy"])
    assert inspect.isclass(import_attr(app_policy.policy_function))
    for d in app["deployments"]:
        ac = AutoscalingConfig(**d["autoscaling_config"])
        assert inspect.isclass(import_attr(ac.policy.policy_function)), d["name"]
        assert not ac.policy.is_default_policy_function(), d["name"]


@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_app_args_validate(name, rs, app):
    AppArgs = _app_args_cls()
    args = AppArgs(**app["args"])
    bundles = args.target_bundles()
    assert isinstance(bundles, list) and len(bundles) == args.tp, bundles
    if args.device == "cuda":
        assert all(b.get("GPU", 0) > 0 for b in bundles), f"cuda target bundles without GPU: {bundles}"


@pytest.mark.slow  # builds the app: loads checkpoint configs and tokenizers (~5 s each)
@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_config_deployments_exist_in_built_app(name, rs, app, tmp_path_factory):
    """Serve rejects config overrides for deployments the builder does not create. Checkpoint
    paths that only exist in the cluster (/models/...) are replaced by a tiny local checkpoint."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as serve_build

    from specdec.loader import ModelLoadError, resolve

    args = dict(app["args"])
    for key in ("target", "draft"):
        if isinstance(args.get(key), str) and args[key].startswith("/") and not Path(args[key]).exists():
            from tiny_models import make_tiny_checkpoint
            args[key] = str(make_tiny_checkpoint(tmp_path_factory.mktemp(f"k8s_{key}"), seed=len(key),
                                                 max_pos=max(1024, int(args.get("max_model_len", 1024)))))
        elif isinstance(args.get(key), str):  # a packaged model (`smollm2`): only its absence may skip
            try:
                resolve(args[key])
            except ModelLoadError as e:
                missing_resource(f"cannot build {name} offline: {e}")
    builder = import_attr(app["import_path"])
    # Anything else that goes wrong here (invalid args: pydantic's ValidationError is a ValueError)
    # is the manifest's fault and fails the test.
    application = call_user_app_builder_with_args_if_necessary(builder, args)
    built = serve_build(application, name=app["name"])
    names = {d.name for d in built.deployments}
    missing = {d["name"] for d in app["deployments"]} - names
    assert not missing, f"config names deployments the app does not have: {missing} (app: {names})"


@pytest.mark.parametrize("bad", [{"no_such_arg": 1}, {"tp": "two"}, {"max_model_len": 10**7}],
                         ids=["unknown-arg", "wrong-type", "cross-check"])
def test_built_app_check_fails_on_invalid_args(bad, tmp_path_factory):
    """Invalid manifest args fail the build check above; they are never skipped as 'offline'."""
    name, rs, app = APPS[0]
    broken = {**app, "args": {**app["args"], **bad}}
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
        test_config_deployments_exist_in_built_app(name, rs, broken, tmp_path_factory)


# ----------------------------------------------------------------------------- resources

def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(v <= have.get(k, 0.0) + 1e-9 for k, v in need.items() if v > 0)


def _per_pod(need: dict[str, float], have: dict[str, float]) -> int:
    return min((math.floor(have.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0), default=0)


def _actor_need(opts: dict) -> dict[str, float]:
    need = {"CPU": float(opts.get("num_cpus", 1)), "GPU": float(opts.get("num_gpus") or 0),
            "memory": float(opts.get("memory") or 0)}
    need.update({k: float(v) for k, v in (opts.get("resources") or {}).items()})
    return need


def _target_need(app: dict) -> tuple[dict[str, float], list[dict]]:
    bundles = _app_args_cls()(**app["args"]).target_bundles()
    total: dict[str, float] = {}
    for b in bundles:  # STRICT_PACK: every bundle of one replica on one node
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + float(v)
    return total, bundles


@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_target_fits_one_gpu_worker_pod(name, rs, app):
    groups = {g: (_ray_resources(spec, head), spec, head) for g, spec, head in _groups(rs)}
    need, bundles = _target_need(app)
    fitting = [g for g, (have, _, head) in groups.items() if not head and _fits(need, have)]
    assert fitting, f"Target needs {need} on one node ({len(bundles)} STRICT_PACK bundles); " \
                    f"groups offer {{{', '.join(f'{g}: {h}' for g, (h, _, _) in groups.items())}}}"
    assert not _fits(need, groups["head"][0]), "the Target must not fit on the head"
    args = app["args"]
    if args.get("device") == "cuda":
        for g in fitting:
            have = groups[g][0]
            assert have.get("GPU", 0) >= len(bundles), f"{g}: {have.get('GPU')} GPUs < TP {len(bundles)}"
        # Kubernetes side: the pod's GPU limit covers the bundles x TP.
        for g in fitting:
            limits = groups[g][1]["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert _quantity(limits.get("nvidia.com/gpu", 0)) >= need.get("GPU", 0), g
            assert _quantity(limits["cpu"]) >= need.get("CPU", 0), g
    target_cfg = next(d for d in app["deployments"] if d["name"] == "Target")
    max_replicas = target_cfg["autoscaling_config"]["max_replicas"]
    capacity = sum(_per_pod(need, groups[g][0]) * groups[g][1]["maxReplicas"] for g in fitting)
    assert capacity >= max_replicas, f"Target max_replicas {max_replicas} > room for {capacity}"


@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_router_and_draft_fit_cpu_group(name, rs, app):
    groups = {g: (_ray_resources(spec, head), spec, head) for g, spec, head in _groups(rs)}
    gpu_groups = {g for g, (have, _, head) in groups.items() if not head and have.get("GPU", 0) > 0}
    from serve_app.builder import SERVE_REPLICA_ENV
    for d in app["deployments"]:
        if d["name"] == "Target":
            continue
        opts = _actor_options(app, d)
        if "ray_actor_options" in d:  # an override replaces the code's whole, runtime_env included: it must restate the replica env
            env = (opts.get("runtime_env") or {}).get("env_vars") or {}
            assert {k: env.get(k) for k in SERVE_REPLICA_ENV} == SERVE_REPLICA_ENV, \
                f"{d['name']}: ray_actor_options.runtime_env lacks {SERVE_REPLICA_ENV}"
        assert "num_cpus" in opts, f"{d['name']}: set ray_actor_options.num_cpus explicitly"
        need = _actor_need(opts)
        fitting = [g for g, (have, _, head) in groups.items() if _fits(need, have)]
        assert fitting and "head" not in fitting, f"{d['name']} ({need}) fits {fitting or 'no group'}"
        assert not set(fitting) & gpu_groups, \
            f"{d['name']} could take CPUs on GPU pods {set(fitting) & gpu_groups}: ask for a CPU-group resource"
        room = sum(_per_pod(need, groups[g][0]) * groups[g][1]["maxReplicas"] for g in fitting)
        assert room >= d["autoscaling_config"]["max_replicas"], f"{d['name']}: room for {room} replicas"
        # The override replaces the code's ray_actor_options: keep it in step with the args.
        cpus_arg = {"Router": "router_cpus", "Draft": "draft_cpus"}.get(d["name"])
        if cpus_arg in app["args"]:
            assert float(opts["num_cpus"]) == float(app["args"][cpus_arg]), \
                f"{d['name']}: ray_actor_options.num_cpus {opts['num_cpus']} != {cpus_arg} {app['args'][cpus_arg]}"


@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_draft_model_gets_a_gpu_on_cuda(name, rs, app):
    """The code loads a draft model (proposer draft/eagle/hybrid/self) on `device`; n-gram runs on CPU."""
    args = _app_args_cls()(**app["args"])
    draft = next((d for d in app["deployments"] if d["name"] == "Draft"), None)
    if draft is None or "ray_actor_options" not in draft:
        return
    if args.device == "cuda" and args.proposer in ("draft", "eagle", "hybrid", "self"):
        assert float(draft["ray_actor_options"].get("num_gpus") or 0) > 0, \
            f"proposer={args.proposer} on cuda: Draft replicas need a GPU (ray_actor_options.num_gpus)"


@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_args_autoscaling_matches_config(name, rs, app):
    args = _app_args_cls()(**app["args"])
    assert args.autoscaling, "deployments have autoscaling_config: set args.autoscaling: true"
    for d in app["deployments"]:
        field = f"max_{d['name'].lower()}_replicas"
        if hasattr(args, field):
            assert getattr(args, field) == d["autoscaling_config"]["max_replicas"], \
                f"{d['name']}: args.{field}={getattr(args, field)} != config max_replicas"


@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_all_replicas_at_max_fit_the_cluster_at_max(name, rs, app):
    supply: dict[str, float] = {}
    for _, spec, head in _groups(rs):
        if head:
            continue
        for k, v in _ray_resources(spec, False).items():
            supply[k] = supply.get(k, 0.0) + v * spec["maxReplicas"]
    demand: dict[str, float] = {}
    for d in app["deployments"]:
        need = _target_need(app)[0] if d["name"] == "Target" else _actor_need(_actor_options(app, d))
        for k, v in need.items():
            demand[k] = demand.get(k, 0.0) + v * d["autoscaling_config"]["max_replicas"]
    short = {k: (v, supply.get(k, 0.0)) for k, v in demand.items() if v > supply.get(k, 0.0) + 1e-9}
    assert not short, f"demand vs supply at max replicas: {short}"


@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_target_weights_are_mounted(name, rs, app):
    """A target path (not the packaged demo) must be on a volume mounted in every Ray pod."""
    target = app["args"]["target"]
    paths = [p for p in (target, app["args"].get("draft")) if p and p.startswith("/")]
    if not paths:
        assert target == "smollm2", f"target {target!r}: use an absolute path on a mounted volume"
        return
    for gname, g, _, c in _containers(rs):
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in g["template"]["spec"].get("volumes", [])}
        for p in paths:
            mp = next((m for m in mounts if p == m or p.startswith(m.rstrip("/") + "/")), None)
            assert mp, f"{gname}: {p} is not under a volumeMount"
            vol = volumes[mounts[mp]["name"]]
            assert "persistentVolumeClaim" in vol, f"{gname}: {mp} is not a PVC"
            assert mounts[mp].get("readOnly"), f"{gname}: mount {mp} read-only"


# ----------------------------------------------------------------------------- serve_config.yaml

@pytest.mark.parametrize("name,rs,app", APPS, ids=APP_IDS)
def test_same_application_as_serve_config(name, rs, app):
    path = ROOT / "serve_config.yaml"
    if not path.is_file():
        missing_resource("serve_config.yaml not found")
    ref = {a["name"]: a for a in yaml.safe_load(path.read_text())["applications"]}
    assert app["name"] in ref, f"serve_config.yaml has no application {app['name']}"
    base = ref[app["name"]]
    assert app["import_path"] == base["import_path"]
    base_deps = {d["name"] for d in base.get("deployments", [])}
    if base_deps:
        assert {d["name"] for d in app["deployments"]} == base_deps, "deployments differ from serve_config.yaml"

    def policies(a):
        out = {d["name"]: (d.get("autoscaling_config") or {}).get("policy", {}).get("policy_function")
               for d in a.get("deployments", [])}
        out["<app>"] = (a.get("autoscaling_policy") or {}).get("policy_function")
        return out

    mine, theirs = policies(app), policies(base)
    differ = {k: (mine.get(k), v) for k, v in theirs.items() if v and mine.get(k) != v}
    assert not differ, f"autoscaling policies differ from serve_config.yaml (manifest, serve_config): {differ}"


def _local_apps():
    path = ROOT / "serve_config.yaml"
    return [(f"serve_config.yaml:{a['name']}", a) for a in yaml.safe_load(path.read_text())["applications"]] \
        if path.is_file() else []


@pytest.mark.parametrize("name,app", [(n, a) for n, _, a in APPS] + _local_apps(),
                         ids=APP_IDS + [n for n, _ in _local_apps()])
def test_policies_size_replicas_as_the_app_builds_them(name, app):
    """A policy block in a config file replaces the builder's autoscaling config, policy_kwargs
    included, so its capacities must be the app's own: a Target replica's slots, a Router
    replica's rows (otherwise a 64-slot Target would scale out at a quarter of its slots)."""
    from serve_app.autoscaling import AutoscalingParams

    args = _app_args_cls()(**app["args"])
    if not args.autoscaling:
        return
    want = {"target_sequences_per_replica": args.target_slots,
            "router_ongoing_per_replica": max(1, args.total_lanes // args.router_replicas) * args.max_batch_size}
    reads = {"<app>": list(want), "Router": ["router_ongoing_per_replica"], "Target": ["target_sequences_per_replica"]}
    blocks = {"<app>": app.get("autoscaling_policy")} | {
        d["name"]: (d.get("autoscaling_config") or {}).get("policy") for d in app.get("deployments", [])}
    for where, policy in blocks.items():
        if not policy or where not in reads:
            continue
        params = AutoscalingParams(**(policy.get("policy_kwargs") or {}))
        for key in reads[where]:
            assert getattr(params, key) == want[key], f"{where}: {key}={getattr(params, key)}, the app's {want[key]}"


# ----------------------------------------------------------------------------- monitoring

def _podmonitors() -> list[dict]:
    return [d for _, d in _all_docs() if d.get("kind") == "PodMonitor"]


def test_podmonitors_scrape_declared_ports():
    pms = _podmonitors()
    assert {pm["spec"]["selector"]["matchLabels"].get("ray.io/node-type") for pm in pms} == {"head", "worker"}
    for pm in pms:
        assert pm["apiVersion"] == "monitoring.coreos.com/v1"
        assert pm["metadata"].get("labels", {}).get("release"), "kube-prometheus-stack needs release: <name>"
        sel = dict(pm["spec"]["selector"]["matchLabels"])
        node_type = sel.pop("ray.io/node-type")
        endpoints = [e["port"] for e in pm["spec"]["podMetricsEndpoints"]]
        assert "metrics" in endpoints
        matched = 0
        for _, rs in RAYSERVICES:
            for gname, g, is_head, c in _containers(rs):
                labels = g["template"].get("metadata", {}).get("labels", {})
                if (node_type == "head") != is_head or any(labels.get(k) != v for k, v in sel.items()):
                    continue
                matched += 1
                ports = {p.get("name") for p in c.get("ports", [])}
                assert set(endpoints) <= ports, f"{gname}: {set(endpoints) - ports} not declared"
        assert matched, f"{pm['metadata']['name']} selects no pod template"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_dashboard_configmap", K8S / "make_dashboard_configmap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dashboard_configmap_generator_roundtrip():
    gen = _load_generator()
    dash = {"title": "specdec", "panels": [{"type": "timeseries", "title": "a\nb: \"c\""}], "tags": []}
    cm = yaml.safe_load(gen.render(json.dumps(dash)))
    assert cm["apiVersion"] == "v1" and cm["kind"] == "ConfigMap"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (key,) = cm["data"]
    assert key.endswith(".json") and json.loads(cm["data"][key]) == dash


def test_dashboard_configmap_in_sync():
    gen = _load_generator()
    out = K8S / "grafana-dashboard-configmap.yaml"
    if not gen.DASHBOARD.is_file():
        if out.is_file():
            pytest.fail(f"{out.name} exists but {gen.DASHBOARD} does not")
        missing_resource("serve_app/grafana/specdec_dashboard.json not found")
    assert out.is_file(), "run: python k8s/make_dashboard_configmap.py"
    expected = gen.render(gen.DASHBOARD.read_text(encoding="utf-8"))
    assert out.read_text(encoding="utf-8") == expected, "stale: run python k8s/make_dashboard_configmap.py"
    cm = yaml.safe_load(out.read_text(encoding="utf-8"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"][gen.DATA_KEY]) == json.loads(gen.DASHBOARD.read_text(encoding="utf-8"))


def test_the_readmes_gpu_config_builds_for_its_example_target(tmp_path, tiny_dir):
    """k8s/README.md's gpu_config.yaml (one machine, 2 GPUs) with a config-only stand-in for its
    example target, Qwen2.5-7B (its real dimensions; the tiny tokenizer): the KV budget holds its
    slots x max_model_len (without kv_cache_memory_gib the build refused it)."""
    import json
    import re
    import shutil
    readme = (ROOT / "k8s" / "README.md").read_text()
    block = re.search(r"```yaml\n(applications:.*?)```", readme, re.S).group(1)
    args = yaml.safe_load(block)["applications"][0]["args"]
    target = tmp_path / "qwen7b"
    target.mkdir()
    for f in tiny_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, target / f.name)
    (target / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
        "max_position_embeddings": 32768, "vocab_size": 152064, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False}))
    a = _app_args_cls()(**{**args, "target": str(target)})
    a.validate_models()
    assert a.max_model_len == args["max_model_len"]
    # and the app fits the machine's 2 GPUs: the TP group takes both, so an n-gram Draft takes none
    from ray.serve._private.build_app import build_app as serve_build

    from serve_app.builder import build_app
    built = serve_build(build_app({**args, "target": str(target)}), name="specdec")
    gpus = {d.name: sum(b.get("GPU", 0) for b in d._replica_config.placement_group_bundles or [])
            or d.ray_actor_options.get("num_gpus", 0) for d in built.deployments}
    assert args["proposer"] == "ngram" and gpus == {"Target": 2, "Draft": 0, "Router": 0}, gpus


@pytest.mark.parametrize("name,rs", RAYSERVICES, ids=RS_IDS)
def test_an_upgrade_keeps_the_old_cluster_while_its_streams_drain(name, rs):
    """The old cluster outlives its traffic by as long as a stopped Router replica drains."""
    from serve_app import constants
    assert rs["spec"].get("rayClusterDeletionDelaySeconds", 60) >= constants.ROUTER_DRAIN_S


@pytest.mark.parametrize("name,rs", RAYSERVICES, ids=RS_IDS)
def test_terminated_worker_pods_drain_their_node_before_ray_stops(name, rs):
    """A worker pod that Kubernetes terminates (node drain, preemption, scale-in) drains its Ray node
    first (docker/drain-node.sh: Serve moves the replicas and lets their streams finish), within a
    deadline that covers a Router's drain and that the pod's grace period outlives."""
    from serve_app import constants
    workers = [(gname, g["template"]["spec"], c) for gname, g, is_head, c in _containers(rs) if not is_head]
    assert workers
    for gname, pod, c in workers:
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[:2] == ["/bin/sh", "/app/docker/drain-node.sh"], f"{gname}: {cmd}"
        assert (ROOT / cmd[1].removeprefix("/app/")).is_file()  # the image is the repository at /app
        # (past the deadline: `ray stop`, up to 16 s, and the drain call's own start)
        assert constants.ROUTER_DRAIN_S < int(cmd[2]) <= pod.get("terminationGracePeriodSeconds", 30) - 25, gname
