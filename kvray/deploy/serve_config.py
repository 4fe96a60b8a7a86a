"""The kvray Serve application as an importable *application builder with arguments*, for
Ray Serve config files and KubeRay's `RayService.spec.serveConfigV2`:

```yaml
applications:
  - name: kvray
    route_prefix: /
    import_path: kvray.deploy.serve_config:app_builder
    args:
      model: /models/Qwen2.5-7B-Instruct   # omit for the embedded SmolLM2
      tp_size: 4
      replicas: 2
      page_size: 16
      cache_policy: radix
      api_key_env: KVRAY_API_KEY          # the key itself comes from a Secret
```

`app_builder(args)` maps those plain arguments (the same knobs as `kvray serve`) onto
`ServeSettings` / `EngineConfig` and calls `build_app`. It checks the arguments, never the
checkpoint: the builder may run on a node (the Ray head) that does not hold the model, and
every replica resolves the checkpoint itself when it starts.
"""

from __future__ import annotations

import os
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvray.config import CachePolicy, DType, EngineConfig
from kvray.deploy.app import ServeSettings, build_app

IMPORT_PATH = "kvray.deploy.serve_config:app_builder"


class ServeArgs(BaseModel):
    """The `args:` of a serve config; unknown keys are an error (a typo must not be ignored)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(
        default=None, description="HF checkpoint dir inside the pods; None = embedded SmolLM2"
    )
    served_model_name: str | None = Field(
        default=None, description="the `model` clients send; default: the checkpoint dir name"
    )
    tp_size: int = Field(default=1, gt=0, description="tensor-parallel GPUs per engine")
    replicas: int = Field(default=1, gt=0, description="data-parallel engines")
    page_size: int = Field(default=16, gt=0)
    cache_policy: CachePolicy = "radix"
    num_pages: int | None = Field(default=None, gt=0)
    kv_cache_memory_gb: float | None = Field(default=None, gt=0)
    max_running_reqs: int = Field(default=256, gt=0)
    max_prefill_tokens: int = Field(default=2048, gt=0)
    max_seq_len: int | None = Field(default=None, gt=1)
    dtype: DType = "auto"
    attention_backend: str = "auto"
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: CUDA when the cluster has GPUs when the engine starts"
    )
    api_key: str | None = Field(default=None, description="prefer api_key_env in real configs")
    api_key_env: str | None = Field(
        default=None, description="name of an env var holding the API key (set from a Secret)"
    )
    app_name: str = "kvray"
    compiled: bool = True
    worker_cpus: float = Field(default=1.0, ge=0)
    public_paths: list[Literal["/metrics", "/openapi.json"]] = Field(
        default_factory=list, description="left open when an API key is set (/health always is)"
    )
    max_tokens_default: int | None = Field(
        default=None, gt=0, description="tokens when a request sets no limit; None: the context"
    )
    max_tokens_cap: int | None = Field(default=None, gt=0, description="refuse larger requests")
    special_tokens_in_messages: bool = Field(
        default=False, description="let typed special-token text in chat be special (vLLM)"
    )


def _none_if_blank(value: Any) -> Any:
    return None if isinstance(value, str) and not value.strip() else value


def _api_key(args: ServeArgs) -> str | None:
    if args.api_key and args.api_key_env:
        raise ValueError("give either api_key or api_key_env, not both")
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            # Fail loudly: serving without the key that was asked for would be open to all.
            raise ValueError(
                f"api_key_env={args.api_key_env!r} is set but that environment variable is "
                "missing or empty on this node (is the Secret mounted into every Ray pod?)"
            )
        return key
    return args.api_key or None


def _model_name(args: ServeArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        from kvray.models.embedded import EMBEDDED_MODEL_NAME

        return EMBEDDED_MODEL_NAME
    return PurePath(args.model.rstrip("/")).name or args.model


def settings_from_args(args: dict[str, Any] | ServeArgs) -> ServeSettings:
    """The ServeSettings a serve config's `args` stand for (validated; Serve not needed)."""
    if not isinstance(args, ServeArgs):
        args = ServeArgs.model_validate({k: _none_if_blank(v) for k, v in dict(args).items()})
    engine: dict[str, Any] = dict(
        model=args.model,
        tp_size=args.tp_size,
        dtype=args.dtype,
        page_size=args.page_size,
        cache_policy=args.cache_policy,
        num_pages=args.num_pages,
        max_running_reqs=args.max_running_reqs,
        max_prefill_tokens=args.max_prefill_tokens,
        max_seq_len=args.max_seq_len,
        attention_backend=args.attention_backend,
        placement_strategy=args.placement_strategy,
        seed=args.seed,
        device=args.device,
    )
    if args.kv_cache_memory_gb is not None:
        engine["kv_cache_memory_gb"] = args.kv_cache_memory_gb
    config = EngineConfig(**engine)  # validates the engine knobs together
    return ServeSettings(
        engine=config.model_dump(),
        model_name=_model_name(args),
        app_name=args.app_name,
        replicas=args.replicas,
        api_key=_api_key(args),
        compiled=args.compiled,
        worker_cpus=args.worker_cpus,
        public_paths=tuple(args.public_paths),
        max_tokens_default=args.max_tokens_default,
        max_tokens_cap=args.max_tokens_cap,
        special_tokens_in_messages=args.special_tokens_in_messages,
    )


def app_builder(args: dict[str, Any]) -> Any:
    """Ray Serve application builder: `import_path: kvray.deploy.serve_config:app_builder`."""
    try:
        settings = settings_from_args(args or {})
    except ValidationError as e:
        raise ValueError(f"invalid kvray serve args: {e}") from None
    return build_app(settings)
