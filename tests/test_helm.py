"""The Helm chart (helm/kvray) and the Serve application builder it runs.

- `helm lint` through Helm's own Go library (helm-sdkpy), offline, for the default values
  and for the 2 replicas x TP 4 example (helm/kvray/ci/tp4-values.yaml); a bad values file
  must fail the same lint.
- values.yaml and the example against values.schema.json (jsonschema); bad values rejected.
- kvray.deploy.serve_config: the serve config `args` -> ServeConfig mapping, without Serve.
- The chart against `ServeConfig` (the one declaration of every setting): each setting has
  its value in the chart, with the same bounds and choices in values.schema.json, and a
  value set in the chart reaches the application's settings.
- When helm-python-sdk is installed too, the chart is rendered offline (Helm's engine) and
  the rendered serveConfigV2 is fed back through the builder: what the chart writes is what
  the application accepts.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvray.deploy.serve_config import IMPORT_PATH, app_builder, settings_from_args
from kvray.deploy.settings import ServeConfig

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvray"
TP4_VALUES = CHART / "ci" / "tp4-values.yaml"

HELM_SDKPY_INSTALL = "pip install --no-deps --ignore-requires-python helm-sdkpy cffi"
HELM_PYTHON_INSTALL = "pip install --no-deps helm-python-sdk"

ERROR_SEVERITY = 3  # Helm's lint severities: 0 unknown, 1 info, 2 warning, 3 error


# -- helpers ---------------------------------------------------------------------------------


def load_yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def coalesce(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's values coalescing (`-f override.yaml` over the chart's values.yaml): maps
    merge recursively, anything else replaces, null deletes a key."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = coalesce(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def chart_values(override: dict[str, Any] | None = None) -> dict[str, Any]:
    return coalesce(load_yaml(CHART / "values.yaml"), override or {})


def schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def schema_errors(values: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema())
    return sorted(
        f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(values)
    )


# -- helm lint (helm-sdkpy: Helm's Go library through cffi) ----------------------------------


@pytest.fixture(scope="module")
def helm_sdkpy(tmp_path_factory):
    try:
        import helm_sdkpy
    except Exception as e:  # noqa: BLE001 - ImportError, or the bundled .so failing to load
        pytest.skip(f"the Helm library is not importable ({e!r}); install it: {HELM_SDKPY_INSTALL}")
    # Keep Helm away from any real kubeconfig / Helm home: lint is offline.
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        "KUBECONFIG": str(home / "no-kubeconfig"),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        try:
            config = helm_sdkpy.Configuration(namespace="default")
        except Exception as e:  # noqa: BLE001 - HelmLibraryNotFound on an unsupported platform
            pytest.skip(f"the Helm library cannot load here ({e!r}); install: {HELM_SDKPY_INSTALL}")
        yield helm_sdkpy, config
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def helm_lint(helm, tmp_path: Path, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """`helm lint helm/kvray [-f override]`. helm-sdkpy's Lint takes a chart directory only,
    so the chart is copied and its values.yaml replaced by the coalesced values: the same
    values `helm lint -f` would lint with (and validate against values.schema.json)."""
    module, config = helm
    chart = tmp_path / "kvray"
    shutil.copytree(CHART, chart)
    if override is not None:
        (chart / "values.yaml").write_text(yaml.safe_dump(chart_values(override)))
    return asyncio.run(module.Lint(config).run(str(chart)))


def lint_errors(result: dict[str, Any]) -> list[str]:
    # helm-sdkpy serializes Go errors as {}; the severity and the file still tell where.
    return [
        f"{m.get('Path')}: severity {m.get('Severity')} {m.get('Err') or ''}".strip()
        for m in result.get("Messages") or []
        if int(m.get("Severity", 0)) >= ERROR_SEVERITY
    ]


def test_helm_lint_default_values(helm_sdkpy, tmp_path):
    result = helm_lint(helm_sdkpy, tmp_path)
    assert result["TotalChartsLinted"] == 1
    assert lint_errors(result) == [], (result, schema_errors(chart_values()))
    assert not result.get("Errors"), result


def test_helm_lint_tp4_values(helm_sdkpy, tmp_path):
    override = load_yaml(TP4_VALUES)
    # The example is what it says: 2 engines x TP 4 on 2 pods x 4 GPUs.
    assert override["engine"]["tpSize"] == 4 and override["engine"]["replicas"] == 2
    assert override["worker"]["gpusPerPod"] == 4 and override["worker"]["replicas"] == 2
    result = helm_lint(helm_sdkpy, tmp_path, override)
    assert result["TotalChartsLinted"] == 1
    assert lint_errors(result) == [], (result, schema_errors(chart_values(override)))
    assert not result.get("Errors"), result


def test_helm_lint_fails_on_bad_values(helm_sdkpy, tmp_path):
    """The lint above is not vacuous: Helm checks the values against values.schema.json."""
    result = helm_lint(helm_sdkpy, tmp_path, {"engine": {"tpSize": -4, "cachePolicy": "lru"}})
    errors = lint_errors(result)
    assert any(e.startswith("values.yaml") for e in errors), result
    assert result.get("Errors"), result


# -- values.schema.json ----------------------------------------------------------------------


def test_schema_is_a_valid_draft7_schema():
    jsonschema.Draft7Validator.check_schema(schema())


def test_default_values_match_schema():
    assert schema_errors(chart_values()) == []


def test_tp4_values_match_schema():
    values = chart_values(load_yaml(TP4_VALUES))
    assert schema_errors(values) == []
    assert values["engine"]["tpSize"] * values["engine"]["replicas"] == 8


@pytest.mark.parametrize(
    "override, where",
    [
        ({"engine": {"tpSize": -1}}, "engine/tpSize"),
        ({"engine": {"tpSize": 0}}, "engine/tpSize"),
        ({"engine": {"tpSize": "4"}}, "engine/tpSize"),
        ({"engine": {"cachePolicy": "lru"}}, "engine/cachePolicy"),
        ({"engine": {"replicas": 0}}, "engine/replicas"),
        ({"engine": {"pageSize": -16}}, "engine/pageSize"),
        ({"engine": {"dtype": "int8"}}, "engine/dtype"),
        ({"engine": {"tpsize": 4}}, "engine"),  # a typo is an error, not a silent default
        ({"worker": {"gpusPerPod": -1}}, "worker/gpusPerPod"),
        ({"serve": {"port": 70000}}, "serve/port"),
        ({"modle": {"path": "/models/x"}}, ""),
    ],
)
def test_schema_rejects_bad_values(override, where):
    errors = schema_errors(chart_values(override))
    assert errors, f"{override} was accepted"
    assert any(e.split(":")[0] == where for e in errors), errors


def test_schema_rejects_a_bad_values_file(tmp_path):
    """A whole bad values file (negative TP, unknown cache policy) on top of the TP 4 example."""
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(TP4_VALUES.read_text() + "\n")
    values = load_yaml(bad)
    values["engine"]["tpSize"] = -4
    values["engine"]["cachePolicy"] = "lru"
    bad.write_text(yaml.safe_dump(values))
    errors = schema_errors(chart_values(load_yaml(bad)))
    assert any(e.startswith("engine/tpSize:") for e in errors), errors
    assert any(e.startswith("engine/cachePolicy:") for e in errors), errors


# -- the application builder (kvray.deploy.serve_config) --------------------------------------


def test_app_builder_maps_args_onto_serve_config(monkeypatch):
    monkeypatch.setenv("TEST_KVRAY_KEY", "s3cret")
    settings = settings_from_args(
        {
            "model": "/models/Qwen2.5-7B-Instruct/",
            "tp_size": 4,
            "replicas": 2,
            "page_size": 256,
            "cache_policy": "naive",
            "num_pages": 4096,
            "max_running_reqs": 64,
            "max_prefill_tokens": 4096,
            "max_seq_len": 8192,
            "dtype": "bfloat16",
            "attention_backend": "torch",
            "placement_strategy": "STRICT_PACK",
            "device": "cuda",
            "api_key_env": "TEST_KVRAY_KEY",
            "app_name": "llm",
            "compiled": False,
            "worker_cpus": 2,
        }
    )
    assert isinstance(settings, ServeConfig)
    assert settings.served_model_name == "Qwen2.5-7B-Instruct"  # the checkpoint dir's name
    assert settings.replicas == 2
    assert settings.api_key == "s3cret"
    assert settings.app_name == "llm"
    assert settings.compiled is False and settings.worker_cpus == 2.0
    cfg = settings.engine_config
    assert cfg.model == "/models/Qwen2.5-7B-Instruct/"
    assert (cfg.tp_size, cfg.page_size, cfg.cache_policy) == (4, 256, "naive")
    assert (cfg.num_pages, cfg.max_running_reqs, cfg.max_prefill_tokens) == (4096, 64, 4096)
    assert (cfg.max_seq_len, cfg.dtype, cfg.attention_backend) == (8192, "bfloat16", "torch")
    assert (cfg.placement_strategy, cfg.device) == ("STRICT_PACK", "cuda")


def test_app_builder_defaults_serve_the_embedded_model():
    from kvray.models.embedded import EMBEDDED_MODEL_NAME

    settings = settings_from_args({})
    assert settings.engine_config.model is None
    assert settings.served_model_name == EMBEDDED_MODEL_NAME
    assert settings.api_key is None and settings.replicas == 1
    assert settings.engine_config.tp_size == 1 and settings.engine_config.cache_policy == "radix"
    # Blank strings (an empty Helm value) mean "not set".
    assert settings_from_args({"model": "", "served_model_name": ""}) == settings
    named = settings_from_args({"model": "/m/llama", "served_model_name": "llama-3"})
    assert named.served_model_name == "llama-3"


def test_app_builder_api_key(monkeypatch):
    assert settings_from_args({"api_key": "k"}).api_key == "k"
    monkeypatch.delenv("TEST_KVRAY_MISSING", raising=False)
    with pytest.raises(ValueError, match="TEST_KVRAY_MISSING"):
        settings_from_args({"api_key_env": "TEST_KVRAY_MISSING"})  # never serve unprotected
    monkeypatch.setenv("TEST_KVRAY_KEY", "k2")
    with pytest.raises(ValueError, match="not both"):
        settings_from_args({"api_key": "k", "api_key_env": "TEST_KVRAY_KEY"})


@pytest.mark.parametrize(
    "args",
    [
        {"tp_size": -1},
        {"tp_size": 0},
        {"cache_policy": "lru"},
        {"replicas": 0},
        {"dtype": "int8"},
        {"tp": 4},  # unknown key (a typo) is an error
    ],
)
def test_app_builder_rejects_bad_args(args):
    with pytest.raises(ValueError):
        app_builder(args)


def test_app_builder_through_serve_import_path(monkeypatch):
    """What Serve does with `import_path` + `args` (no Serve started)."""
    from ray._common.utils import import_attr
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    builder = import_attr(IMPORT_PATH)
    assert builder is app_builder
    args = {"model": "/models/x", "tp_size": 2, "replicas": 3, "page_size": 32}
    app = call_user_app_builder_with_args_if_necessary(builder, args)
    assert isinstance(app, Application)
    ingress = app._bound_deployment
    engine_app, raw = ingress.init_args
    assert raw == settings_from_args(args).model_dump()
    assert engine_app._bound_deployment.num_replicas == 3  # data-parallel engines


# -- rendering (helm-python-sdk: Helm's template engine, offline) ------------------------------


@pytest.fixture(scope="module")
def helm_render():
    try:
        import helm_python
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"helm-python-sdk is not importable ({e!r}); to render: {HELM_PYTHON_INSTALL}")
    chart = helm_python.Chart.load(str(CHART))

    def render(override: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        out = chart.render(override or {}, name="llm", namespace="ai", is_install=True)
        docs = []
        for path, text in sorted(out.items()):
            if path.endswith((".yaml", ".yml")):
                docs += [d for d in yaml.safe_load_all(text) if d]
        return docs

    render.error = helm_python.HelmError
    return render


def _kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _serve_app(rayservice: dict[str, Any]) -> dict[str, Any]:
    """The kvray application of a rendered RayService, after Ray Serve's own schema for
    serve config files (what the Serve REST API that KubeRay calls validates) accepts it."""
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    return app


def test_render_default_values(helm_render):
    docs = helm_render()
    assert {d["kind"] for d in docs} == {"RayService"}
    (rs,) = docs
    assert rs["apiVersion"] == "ray.io/v1"
    app = _serve_app(rs)
    assert app["import_path"] == IMPORT_PATH and app["route_prefix"] == "/"
    settings = settings_from_args(app["args"])
    assert settings.engine_config.model is None  # the embedded model
    assert settings.engine_config.device == "cuda"  # the worker group has GPUs
    cluster = rs["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (container,) = head["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["serve"], ports["metrics"], ports["dashboard"]) == (8000, 8080, 8265)
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    (group,) = cluster["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_render_cpu_workers(helm_render):
    """worker.gpusPerPod 0 (a CPU-only cluster, e.g. kind): no GPU requests, CPU engines."""
    (rs,) = helm_render({"worker": {"gpusPerPod": 0}})
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert "nvidia.com/gpu" not in json.dumps(group["template"]["spec"]["containers"])
    assert settings_from_args(_serve_app(rs)["args"]).engine_config.device == "cpu"


def test_render_tp4_values(helm_render, monkeypatch):
    docs = helm_render(load_yaml(TP4_VALUES))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Ingress", "RayService", "Service", "ServiceMonitor"]
    (rs,) = _kind(docs, "RayService")
    monkeypatch.setenv("KVRAY_API_KEY", "from-the-secret")
    app = _serve_app(rs)
    assert "api_key" not in app["args"]  # only the env var's name is in the spec
    settings = settings_from_args(app["args"])
    assert settings.replicas == 2 and settings.api_key == "from-the-secret"
    cfg = settings.engine_config
    assert (cfg.tp_size, cfg.page_size, cfg.cache_policy) == (4, 256, "radix")
    assert cfg.model == "/models/Qwen2.5-7B-Instruct"
    assert settings.served_model_name == "qwen2.5-7b-instruct"

    cluster = rs["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 2)
    pod = group["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert pod["nodeSelector"] and pod["tolerations"] and pod["affinity"]
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts == {"model": "/models", "dshm": "/dev/shm"}
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    for container in (worker, head_pod["containers"][0]):  # the key reaches every Ray pod
        env = {e["name"]: e for e in container["env"]}
        ref = env["KVRAY_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "kvray-api-key", "key": "api-key"}

    (ingress,) = _kind(docs, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{rs['metadata']['name']}-serve-svc", "port": {"number": 8000}}
    (monitor,) = _kind(docs, "ServiceMonitor")
    assert {"port": "serve", "path": "/metrics"}.items() <= monitor["spec"]["endpoints"][0].items()
    # /metrics needs the API key too: the scrape sends it from the same Secret
    auth = monitor["spec"]["endpoints"][0]["authorization"]
    assert auth == {"type": "Bearer", "credentials": {"name": "kvray-api-key", "key": "api-key"}}
    assert "authorization" not in monitor["spec"]["endpoints"][1]  # Ray's own metrics port


def test_render_optional_pieces(helm_render, monkeypatch):
    docs = helm_render(
        {
            "apiKey": {"enabled": True, "value": "k"},
            "model": {
                "path": "/models/m",
                "volume": {"emptyDir": {}},
                "credentialsSecret": "hf-token",
                "download": {"enabled": True, "command": ["hf", "download", "org/m"]},
            },
            "metrics": {"podMonitor": {"enabled": True}},
        }
    )
    (secret,) = _kind(docs, "Secret")
    assert secret["data"] == {"api-key": "aw=="}  # base64("k")
    monitors = _kind(docs, "PodMonitor")
    assert len(monitors) == 2  # kvray:* from the head, ray_* from every pod
    serve_endpoint = monitors[0]["spec"]["podMetricsEndpoints"][0]
    assert serve_endpoint["authorization"]["credentials"]["key"] == "api-key"
    (rs,) = _kind(docs, "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
        assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    monkeypatch.setenv("KVRAY_API_KEY", "k")
    assert settings_from_args(_serve_app(rs)["args"]).api_key == "k"


@pytest.mark.parametrize(
    "override, message",
    [
        ({"engine": {"tpSize": 4, "replicas": 2}}, "8 GPUs"),
        ({"engine": {"tpSize": 4}, "worker": {"replicas": 4, "maxReplicas": 4}}, "STRICT_PACK"),
        ({"worker": {"replicas": 3, "maxReplicas": 2}}, "worker.replicas"),
        (  # 6 GPUs in all, but a 3-GPU pod holds one TP-2 engine: 2 of the 3 fit
            {
                "engine": {"tpSize": 2, "replicas": 3, "placementStrategy": "STRICT_PACK"},
                "worker": {"gpusPerPod": 3, "replicas": 2, "minReplicas": 2, "maxReplicas": 2},
            },
            "hold 2 whole engines of TP 2",
        ),
        ({"apiKey": {"enabled": True}}, "apiKey"),
    ],
)
def test_render_rejects_impossible_layouts(helm_render, override, message):
    with pytest.raises(helm_render.error, match=message):
        helm_render(override)


# -- the chart against ServeConfig, the one declaration of every setting -----------------------

# Settings whose chart value is not values.engine/serve.<camelCase name>.
CHART_HOMES = {
    "model": ("model", "path"),
    "served_model_name": ("model", "servedModelName"),
    "served_model_aliases": ("model", "servedModelAliases"),
    "compiled": ("engine", "compiledGraph"),
    "app_name": ("serve", "appName"),
}
# Never a value: the key reaches the pods from a Secret, named by api_key_env (apiKey.*).
SECRET_SETTINGS = {"api_key", "api_key_env"}
# Chart values that are not application settings.
CHART_ONLY = {("serve", "routePrefix"), ("serve", "port"), ("serve", "extraConfig")}


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)


def _chart_home(name: str) -> tuple[str, str]:
    if name in CHART_HOMES:
        return CHART_HOMES[name]
    key = _camel(name)
    return ("engine" if key in schema()["properties"]["engine"]["properties"] else "serve", key)


def _chart_value(name: str) -> Any:
    section, key = _chart_home(name)
    return load_yaml(CHART / "values.yaml")[section][key]


def _settings_in_chart() -> dict[str, tuple[str, str]]:
    return {n: _chart_home(n) for n in ServeConfig.model_fields if n not in SECRET_SETTINGS}


def test_every_setting_has_one_value_in_the_chart():
    values, props = load_yaml(CHART / "values.yaml"), schema()["properties"]
    homes = _settings_in_chart()
    for name, (section, key) in homes.items():
        assert key in values[section], f"{name}: no {section}.{key} in values.yaml"
        assert key in props[section]["properties"], f"{name}: {section}.{key} not in the schema"
    mapped = set(homes.values()) | CHART_ONLY
    for section in ("engine", "serve"):
        stale = {(section, k) for k in props[section]["properties"]} - mapped
        assert not stale, f"chart values that are no kvray setting: {sorted(stale)}"


def _bounds(field: Any) -> dict[str, float]:
    out = {}
    for m in field.metadata:
        for attr in ("gt", "ge"):
            if getattr(m, attr, None) is not None:
                out[attr] = getattr(m, attr)
    return out


@pytest.mark.parametrize("name", sorted(_settings_in_chart()))
def test_the_schema_says_what_the_setting_accepts(name):
    import typing

    field = ServeConfig.model_fields[name]
    section, key = _chart_home(name)
    prop = schema()["properties"][section]["properties"][key]
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    nullable = type(None) in typing.get_args(annotation)
    kind = args[0] if nullable and len(args) == 1 else annotation
    types = prop.get("type", [])
    types = types if isinstance(types, list) else [types]
    if nullable and name not in ("model", "served_model_name"):  # those are "" for unset
        assert "null" in types, f"{name} may be None: the schema must allow null"
    if not nullable and "null" in types:  # null in the chart means "kvray's default"
        assert _chart_value(name) is None, f"{name}: null allowed, so the chart default is null"
    origin = typing.get_origin(kind)
    if origin is typing.Literal:
        assert set(prop["enum"]) - {None} == set(typing.get_args(kind)), name
    elif origin is tuple and typing.get_args(kind)[0] is str:
        assert prop["type"] == "array" and prop["items"] == {"type": "string"}, name
    elif origin is tuple:
        assert set(prop["items"]["enum"]) == set(typing.get_args(typing.get_args(kind)[0]))
    elif kind is bool:
        assert [t for t in types if t != "null"] == ["boolean"], name
    elif kind in (int, float):
        assert (kind is int) == ("integer" in types), f"{name}: {types}"
        bounds = _bounds(field)
        if "gt" in bounds and kind is int:
            assert prop.get("minimum") == bounds["gt"] + 1, name
        elif "gt" in bounds:
            assert prop.get("exclusiveMinimum") == bounds["gt"], name
        elif "ge" in bounds:
            assert prop.get("minimum") == bounds["ge"], name
        else:
            assert "minimum" not in prop and "exclusiveMinimum" not in prop, name


def test_every_chart_value_reaches_the_application(helm_render):
    """Each setting set to something other than its default in the chart arrives, through
    the template and serve_config's builder, in the application's settings."""
    chosen = {
        "model": "/models/m",
        "served_model_name": "m-1",
        "served_model_aliases": ("m", "org/m-1"),
        "tp_size": 2,
        "dtype": "float16",
        "device": "cpu",
        "page_size": 32,
        "num_pages": 100,
        "kv_cache_memory_gb": 1.5,
        "cache_policy": "naive",
        "max_running_reqs": 7,
        "max_prefill_tokens": 300,
        "itl_target_ms": 100.0,
        "speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
        "max_seq_len": 999,
        "attention_backend": "torch",
        "seed": 5,
        "placement_strategy": "SPREAD",
        "replicas": 3,
        "app_name": "app2",
        "compiled": False,
        "overlap_schedule": False,  # (speculative_tokens needs it off)
        "worker_cpus": 2.0,
        "worker_threads": 3,
        "bind_threads": False,
        "small_batch_kernel": True,
        "step_channel": False,
        "router": "round-robin",
        "router_load_margin": 9,
        "share_kv": True,
        "share_kv_min_tokens": 64,
        "request_channel": False,
        "public_paths": ("/metrics",),
        "max_tokens_default": 64,
        "max_tokens_cap": 128,
        "special_tokens_in_messages": True,
        "health_timeout_s": 3.0,
        "generation_config": "none",
        "chat_template": "{{ messages[0]['content'] }}",
        "allowed_origins": ("https://app.example",),
    }
    assert set(chosen) == set(_settings_in_chart())
    override: dict[str, Any] = {"worker": {"gpusPerPod": 0}}  # device "cpu" without GPUs
    for name, value in chosen.items():
        section, key = _chart_home(name)
        default = ServeConfig.model_fields[name].get_default(call_default_factory=True)
        assert value != default, f"{name}: pick a value other than the default"
        override.setdefault(section, {})[key] = list(value) if isinstance(value, tuple) else value
    (rs,) = _kind(helm_render(override), "RayService")
    settings = settings_from_args(_serve_app(rs)["args"])
    got = {name: getattr(settings, name) for name in chosen}
    assert got == chosen


def test_a_null_itl_target_turns_it_off(helm_render):
    """engine.itlTargetMs null is the target off (None), as in a serve config; the chart's
    default is kvray serve's (checked below)."""
    (rs,) = _kind(helm_render({"engine": {"itlTargetMs": None}}), "RayService")
    assert settings_from_args(_serve_app(rs)["args"]).itl_target_ms is None
    assert settings_from_args({"itl_target_ms": None}).itl_target_ms is None
    assert settings_from_args({}).itl_target_ms == 250.0


# Where the chart's defaults deliberately differ from kvray's, and why.
CHART_DEFAULTS = {
    "placement_strategy": "STRICT_PACK",  # one engine's TP workers on one pod (NVLink)
    "device": "cuda",  # decided from worker.gpusPerPod (1 by default), not at start-up
}


def test_chart_defaults_are_kvrays(helm_render):
    """A chart value left null stands for kvray's default; one written out must equal it,
    unless CHART_DEFAULTS says why not. So a default changed in EngineConfig/ServeConfig
    cannot silently differ in the chart."""
    (rs,) = _kind(helm_render(), "RayService")
    settings = settings_from_args(_serve_app(rs)["args"])
    for name in _settings_in_chart():
        field = ServeConfig.model_fields[name]
        default = field.get_default(call_default_factory=True)
        got = getattr(settings, name)
        if name in ("model", "served_model_name"):
            continue  # resolved from the checkpoint (the embedded model here)
        expected = CHART_DEFAULTS.get(name, default)
        assert got == expected, f"{name}: the chart gives {got!r}, kvray's default is {default!r}"
