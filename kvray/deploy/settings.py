"""`ServeConfig`: the server's settings, declared once, extending `EngineConfig`.

It is at once the `args:` of a Ray Serve config (`kvray.deploy.serve_config:app_builder`,
the Helm chart's serveConfigV2), the flags of `kvray serve` (`kvray.deploy.flags`) and what
every Serve replica is handed, once `resolved()`: the checkpoint path, the served model
name and the API key settled where the app is built.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import PurePath
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from kvray.config import EngineConfig, cli_aliases

PublicPath = Literal["/metrics", "/openapi.json"]


def served_names(name: str, aliases: Iterable[str] = ()) -> tuple[str, ...]:
    """The names a model is served under: `name`, which responses carry, then each alias
    once."""
    return tuple(dict.fromkeys((name, *aliases)))


class ServeConfig(EngineConfig):
    """An engine's settings plus the server's. Unknown keys are an error (a typo in a serve
    config must not be ignored)."""

    itl_target_ms: float | None = FieldInfo.merge_field_infos(
        EngineConfig.model_fields["itl_target_ms"],
        default=250.0,
        description="inter-token-latency target, on for a server: a step with running "
        "decodes computes only as many prompt tokens as fit in this many ms by a step-time "
        "model learned online (but at least a sixteenth of max_prefill_tokens, or a "
        "sixteenth for every two requests waiting to start when that is more). 250 ms keeps "
        "streams near 4 tokens/s while a long prompt prefills (a whole 2,048-token chunk "
        "takes ~1.7 s on a small CPU) and rarely binds on a GPU, where a full chunk usually "
        "takes less; unset (null): off, every step computes up to max_prefill_tokens",
    )

    served_model_name: str | None = Field(
        default=None,
        description="the `model` clients send, and responses name; None: the checkpoint "
        "directory's name, or the Hugging Face model id the model was given as. Several "
        "names (as vLLM's flag takes them): the first is this, the others served_model_aliases",
        json_schema_extra={"nargs": "+"},
    )
    served_model_aliases: tuple[str, ...] = Field(
        default=(),
        description="other names a request's `model` may give (each listed by /v1/models); "
        "responses name served_model_name",
        json_schema_extra={"nargs": "+"},
    )
    replicas: int = Field(default=1, gt=0, description="data-parallel engines behind Serve")
    router: Literal["prefix", "pow2", "round-robin"] | None = Field(
        default=None,
        description="how requests pick an engine replica: prefix (the replica whose prefix "
        "cache holds the most of the prompt, unless it is loaded past router_load_margin), "
        "pow2 (Serve's power of two choices) or round-robin; unset: prefix with more than "
        "one replica",
    )
    router_load_margin: int = Field(
        default=4,
        ge=0,
        description="prefix routing sends a request to the least loaded replica instead "
        "once the best-matching one has more than this many more requests in flight",
    )
    share_kv: bool = Field(
        default=False,
        description="a replica routed a request whose prompt prefix another replica caches "
        "(share_kv_min_tokens more of it) copies that prefix's K/V from it through Ray's "
        "object store instead of computing it (router prefix or round-robin)",
    )
    share_kv_min_tokens: int = Field(
        default=256, gt=0, description="the least gain in cached tokens worth a K/V fetch"
    )
    app_name: str = Field(default="kvray", min_length=1, description="the Serve app's name")
    api_key: str | None = Field(
        default=None,
        description="require this bearer key (or set KVRAY_API_KEY); prefer api_key_env in configs",
    )
    api_key_env: str | None = Field(
        default=None, description="name of an environment variable holding the API key"
    )
    compiled: bool | None = Field(
        default=None,
        description=(
            "dispatch steps over Ray compiled graphs (else plain actor calls); "
            "unset: compiled graphs on GPUs, plain calls on CPU"
        ),
        json_schema_extra=cli_aliases("--compiled-graph"),
    )
    worker_cpus: float = Field(default=1.0, ge=0, description="CPUs each TP worker reserves")
    worker_threads: int | None = Field(
        default=None,
        gt=0,
        description="torch threads of each CPU TP worker; unset: the node's cores shared by "
        "every worker of every replica (cores / (tp_size x replicas)), as if all ran on one "
        "node: set it on a multi-node CPU cluster",
    )
    public_paths: tuple[PublicPath, ...] = Field(
        default=(),
        description="paths left open when an API key is set (/health always is)",
        json_schema_extra=cli_aliases("--public-path"),
    )
    chat_template: str | None = Field(
        default=None,
        description="a chat template instead of the tokenizer's (for a checkpoint with none, "
        "or to change it): the Jinja text, or a file holding it, read where the app starts",
    )
    allowed_origins: tuple[str, ...] = Field(
        default=(),
        description="origins a browser may call the API from (CORS; '*' for any); several "
        "after the flag, comma-separated, or vLLM's JSON list. Empty: no CORS headers, so "
        "browsers on other origins are refused",
        json_schema_extra={"nargs": "+"},
    )
    generation_config: Literal["auto", "none"] = Field(
        default="auto",
        description="auto: the sampling settings a request leaves unset (temperature, top_p, "
        "top_k, min_p, repetition_penalty, and max_tokens from max_new_tokens) default to the "
        "checkpoint's generation_config.json, as in vLLM; none: to OpenAI's (temperature 1, "
        "top_p 1; vLLM calls this 'vllm')",
        json_schema_extra={"value_aliases": {"vllm": "none"}},
    )
    max_tokens_default: int | None = Field(
        default=None,
        gt=0,
        description="tokens to generate when a request sets no limit; None: the rest of the "
        "context",
    )
    max_tokens_cap: int | None = Field(
        default=None, gt=0, description="refuse requests asking for more tokens than this"
    )
    special_tokens_in_messages: bool = Field(
        default=False,
        description="let special-token text typed in chat messages become special tokens "
        "(as vLLM does)",
    )
    request_channel: bool = Field(
        default=True,
        description="with one engine replica, the ingress submits requests and reads their "
        "tokens over a Unix socket to the engine's scheduler when both run on one node "
        "(kvray.cluster.request_channel), not through the engine deployment and Ray calls",
    )
    health_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="/health: a busy engine must have made progress within this many seconds, "
        "and an idle one answer a one-token probe within them",
    )

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _json_list(cls, value: object) -> object:
        """vLLM's spelling, one JSON list (`--allowed-origins '["*"]'`, or that string in a
        serve config), read as the list; any other string is one origin."""
        if isinstance(value, list | tuple) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                import json

                return json.loads(value)
            value = [value]
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            # "a,b" is two origins (an origin never holds a comma)
            return [o.strip() for v in value for o in v.split(",") if o.strip()]
        return value

    @model_validator(mode="before")
    @classmethod
    def _several_names(cls, data: object) -> object:
        """Several served model names (the flag's list, or a list in a config), as vLLM
        takes them: the first names responses, every one is accepted as a request's
        `model`. The aliases keep their order, without blanks, repeats or the first name."""
        if not isinstance(data, dict):
            return data
        names = data.get("served_model_name")
        names = list(names) if isinstance(names, list | tuple) else [names]
        aliases = data.get("served_model_aliases", ())
        aliases = [aliases] if isinstance(aliases, str) else list(aliases)
        if not all(n is None or isinstance(n, str) for n in names + aliases):
            return data  # the fields' own validation names what is wrong
        names = [n for n in names if n is not None and n.strip()]
        first = names[0] if names else None
        rest = [a for a in names[1:] + aliases if a.strip() and a != first]
        return {
            **data,
            "served_model_name": first,
            "served_model_aliases": tuple(dict.fromkeys(rest)),
        }

    @field_validator("generation_config", mode="before")
    @classmethod
    def _vllm_name(cls, value: object) -> object:
        return "none" if value == "vllm" else value

    @field_validator("api_key", "api_key_env", "model", "served_model_name", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        """An empty string (e.g. an unset Helm value) means the default."""
        return None if isinstance(value, str) and not value.strip() else value

    @property
    def threads_per_worker(self) -> int:
        """`worker_threads`, or the default it describes."""
        if self.worker_threads is not None:
            return self.worker_threads
        return max(1, (os.cpu_count() or 1) // (self.tp_size * self.replicas))

    @property
    def routing(self) -> str:
        """The router in effect (`router`, or its default for this many replicas)."""
        if self.router is not None:
            return self.router
        return "prefix" if self.replicas > 1 else "pow2"

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{name: getattr(self, name) for name in EngineConfig.model_fields})

    def resolved(self, model_path: str | None = None) -> ServeConfig:
        """These settings with what replicas need settled: the API key (from api_key_env
        when named: a missing variable is an error, never an open server), the served model
        name, and `model_path` (a resolved checkpoint) when given."""
        if self.api_key and self.api_key_env:
            raise ValueError("give either api_key or api_key_env, not both")
        key = self.api_key
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(
                    f"api_key_env={self.api_key_env!r} is set but that environment variable is "
                    "missing or empty on this node (is the Secret mounted into every Ray pod?)"
                )
        from kvray.cluster.spec import is_hub_id

        model = model_path or self.model
        name = self.served_model_name
        if name is None and self.model is None:
            from kvray.models.embedded import EMBEDDED_MODEL_NAME

            name = EMBEDDED_MODEL_NAME
        elif name is None and is_hub_id(self.model):  # as vLLM: the id clients know it by
            name = self.model
        elif name is None:
            assert model is not None
            name = PurePath(model.rstrip("/")).name or model
        template = self.chat_template
        if template is not None:  # a file is read here; replicas elsewhere get its text
            from kvray.text import load_chat_template

            template = load_chat_template(template)
        return self.model_copy(
            update={
                "api_key": key,
                "api_key_env": None,
                "model": model,
                "served_model_name": name,
                "served_model_aliases": tuple(a for a in self.served_model_aliases if a != name),
                "chat_template": template,
            }
        )
