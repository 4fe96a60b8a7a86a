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

`app_builder(args)` validates those arguments as a `ServeConfig` (`kvray.deploy.settings`:
the same settings as `kvray serve`'s flags, every `EngineConfig` field among them), resolves
the API key and the served model name, and calls `build_app`. It checks the arguments, never
the checkpoint: the builder may run on a node (the Ray head) that does not hold the model,
and every replica resolves the checkpoint itself when it starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvray.deploy.app import build_app
from kvray.deploy.settings import ServeConfig

IMPORT_PATH = "kvray.deploy.serve_config:app_builder"


def settings_from_args(args: dict[str, Any]) -> ServeConfig:
    """The resolved settings a serve config's `args` stand for (validated; Serve not
    needed). A blank string means the default (an unset Helm value)."""
    return ServeConfig.model_validate(dict(args)).resolved()


def app_builder(args: dict[str, Any]) -> Any:
    """Ray Serve application builder: `import_path: kvray.deploy.serve_config:app_builder`."""
    try:
        settings = settings_from_args(args or {})
    except ValidationError as e:
        raise ValueError(f"invalid kvray serve args: {e}") from None
    return build_app(settings)
