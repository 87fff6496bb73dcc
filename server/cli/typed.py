"""CLI of the typed per-model APIs: ``inferplane proto NAME [--version V]`` prints the .proto;
``inferplane endpoints retire-schema NAME v1`` stops serving an older schema major.

Both talk to the running frontend's admin gRPC (``--url``). ``mount(app)`` adds them to the
``inferplane`` command (``proto``) and its ``endpoints`` group; ``python -m server.cli.typed``
runs them on their own.
"""

from __future__ import annotations

from typing import Optional

import typer

from server.cli.options import ACTOR, API_KEY, URL
from server.cli.registry import admin, endpoints_app


def proto(
    name: str = typer.Argument(..., help="Model (endpoint) name."),
    version: Optional[str] = typer.Option(
        None, "--version", help="A schema major (v2) or a model version (3): the schema it is served under. Default: the newest schema."
    ),
    url: str = URL,
    actor: Optional[str] = ACTOR,
    api_key: Optional[str] = API_KEY,
) -> None:
    """Print the .proto of a model's typed gRPC API (generate stubs from it in any language)."""
    from server.protogen.inferplane.v1 import admin_pb2

    with admin(url, actor, api_key) as call:
        response = call("GetModelProto", admin_pb2.GetModelProtoRequest(name=name, version=version or ""), 30)
    typer.echo(response.proto, nl=False)


def retire_schema(
    name: str = typer.Argument(..., help="Endpoint (model) name."),
    major: str = typer.Argument(..., help="The schema major to retire: v1, v2, ..."),
    url: str = URL,
    actor: Optional[str] = ACTOR,
    api_key: Optional[str] = API_KEY,
) -> None:
    """Stop serving an older typed-API schema major (kept after a breaking change bumped it)."""
    from server.protogen.inferplane.v1 import admin_pb2

    with admin(url, actor, api_key) as call:
        response = call("RetireSchema", admin_pb2.RetireSchemaRequest(name=name, major=major), 30)
    kept = ", ".join(f"v{s.major} ({s.service})" for s in response.served)
    typer.echo(f"retired {name} {major if major.lower().startswith('v') else 'v' + major}; still served: {kept}")


def mount(app: typer.Typer) -> None:
    app.command("proto")(proto)
    endpoints_app.command("retire-schema")(retire_schema)


def main() -> None:
    """``python -m server.cli.typed``: these commands alone (with the ``endpoints`` group)."""
    app = typer.Typer(help="Typed per-model gRPC APIs.", no_args_is_help=True, add_completion=False)
    mount(app)
    app.add_typer(endpoints_app, name="endpoints")
    app()


if __name__ == "__main__":
    main()
