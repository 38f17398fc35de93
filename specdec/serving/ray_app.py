"""Replicas on Ray Serve: each replica is a whole specdec server (models, scheduler, app), and
Ray Serve's proxy spreads requests over them. Needs ``pip install "specdec[ray]"``.

    from ray import serve
    from specdec.serving.ray_app import deployment

    serve.run(deployment(num_replicas=2, target="path/to/target", draft="path/to/draft"))

or from a shell: ``serve run specdec.serving.ray_app:app_builder num_replicas=2 target=... draft=...``
(docs/serving.md: across machines).
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve


@serve.ingress()
class SpecdecReplica:
    """One replica: loads its models and builds its server when Ray starts it."""

    def __init__(self, target: str | None = None, draft: str | None = None, drafter: str = "model",
                 dtype: str = "float32", gamma: int = 4, speculation: str = "auto", max_batch: int = 32,
                 model_name: str | None = None, api_key: str | None = None) -> None:
        from specdec.defaults import default_model
        from specdec.drafting import make_drafter
        from specdec.models.loading import load
        from specdec.names import TEXT_DRAFTERS, base_kinds
        from specdec.serving.app import ServerLimits
        from specdec.serving.server import build_app

        if target is None:  # the bundled pair
            target, draft = str(default_model("target")), str(default_model("draft"))
        target_model = load(target, dtype=dtype)
        draft_model = load(draft, dtype=dtype) if draft else None
        needs_model = any(kind not in TEXT_DRAFTERS for kind in base_kinds(drafter))
        chosen = (
            make_drafter(drafter, draft_model, target=target_model)
            if draft_model is not None or not needs_model
            else None
        )
        self.asgi_app = build_app(
            target_model,
            chosen,
            model_name or target_model.name,
            gamma=gamma,
            speculation=speculation,
            max_batch=max_batch,
            # as `specdec serve --api-key`: Ray Serve's proxy checks no one, and listens beyond loopback
            # across machines; else $SPECDEC_API_KEY in the replica's environment (a runtime_env's env_vars)
            limits=ServerLimits(api_key=api_key or os.environ.get("SPECDEC_API_KEY")),
        )

    def __serve_build_asgi_app__(self):
        return self.asgi_app


def deployment(num_replicas: int = 2, num_cpus: float = 1.0, **options: Any) -> serve.Application:
    """A Ray Serve application of ``num_replicas`` specdec servers; options go to SpecdecReplica."""
    # As a decorator: Ray's annotation says serve.deployment returns one, whatever it is given
    # (mypy, with Ray installed, refuses .bind on serve.deployment(cls, ...)).
    replica = serve.deployment(num_replicas=num_replicas, ray_actor_options={"num_cpus": num_cpus})(SpecdecReplica)
    return replica.bind(**options)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For ``serve run specdec.serving.ray_app:app_builder key=value ...``."""
    options = dict(args)
    num_replicas = int(options.pop("num_replicas", 2))
    for key in ("gamma", "max_batch"):
        if key in options:
            options[key] = int(options[key])
    if "num_cpus" in options:  # the command line gives text; Ray wants a number of CPUs per replica
        options["num_cpus"] = float(options["num_cpus"])
    return deployment(num_replicas=num_replicas, **options)
