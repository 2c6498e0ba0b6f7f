"""``felixctl acl``: print (and apply) the Redis ACL rules of a felix-redis role."""

from __future__ import annotations

import os

import click

from felix_redis import acl as felix_acl
from felix_redis import scripts
from felix_redis.errors import InvalidArgument
from felixctl.common import Ctl, OperationError, examples, hide_password, pass_ctl


@click.group(epilog=examples(
    "felixctl acl grant alice --tenant acme --namespace prod --stream jobs --group workers --role group.consume"))
def acl() -> None:
    """Redis ACL rules for felix-redis roles, and the function library (docs/security.md)."""


@acl.command(
    "grant",
    epilog=examples(
        "felixctl acl grant alice --stream jobs --group workers --role group.consume",
        "felixctl acl grant ops --stream jobs --group workers --role group.manage --apply",
        "FELIX_PW=s3cret felixctl acl grant app --stream jobs --role stream.publish --password-from-env FELIX_PW "
        "--apply",
        note="Rules only add to what USER has; --reset starts the user over (and drops its passwords). "
        "Set a password separately with ACL SETUSER USER >password, or with --password-from-env. "
        "--apply runs the command on every data node: on Sentinel the primary and every replica the "
        "sentinels know, on Cluster every node (ACL SETUSER is not replicated); a node it cannot reach "
        "is named and the exit status is 1. --apply also installs this version's function library "
        "(felixctl install): roles run the library's functions and nothing else.",
    ),
)
@click.argument("user")
@click.option("--tenant", default=None, help="Tenant (default: the global --tenant).")
@click.option("--namespace", default=None, help="Namespace (default: the global --namespace).")
@click.option("--stream", required=True, help="The stream the role is granted on.")
@click.option("--group", default=None, help="The group (group.consume and group.manage).")
@click.option("--role", type=click.Choice(felix_acl.ROLES), required=True, help="The role to grant.")
@click.option("--apply", "apply_", is_flag=True,
              help="Run the ACL SETUSER command too, on every data node (replicas, every Cluster node).")
@click.option("--reset", is_flag=True, help="Start the user over: 'reset' first (drops its passwords).")
@click.option("--password-from-env", metavar="VAR", default=None,
              help="Also set the password held in environment variable VAR (never printed).")
@pass_ctl
def grant(
    ctl: Ctl, user: str, tenant: str | None, namespace: str | None, stream: str, group: str | None, role: str,
    apply_: bool, reset: bool, password_from_env: str | None,
) -> None:
    """Print the ACL SETUSER command granting ROLE to USER; with --apply, run it."""
    password = None
    if password_from_env is not None:
        password = os.environ.get(password_from_env)
        if not password:
            raise InvalidArgument(f"environment variable {password_from_env} is not set or empty")
    rules = felix_acl.rules(role, tenant or ctl.tenant, namespace or ctl.namespace, stream, group)
    args = felix_acl.setuser_args(user, rules, reset=reset, password=password)
    click.echo(felix_acl.format_command(args))
    if apply_:
        results = felix_acl.grant_everywhere(ctl.client, args)
        for result in results:
            if result.ok:
                click.echo(f"applied: {role} for user {user} on {result}", err=True)
            else:
                click.echo(f"not applied on {result}: {hide_password(result.error or '', ctl.known_url)}",
                           err=True)
        failed = [r for r in results if not r.ok]
        if not failed:
            # roles call the library's functions only: install this version's (idempotent)
            name = ctl.client.load_library()
            click.echo(f"installed: function library {name}", err=True)
        if failed:
            raise OperationError(
                f"ACL SETUSER {user} not applied on {len(failed)} of {len(results)} nodes: "
                + ", ".join(str(r) for r in failed) + " (run it again once they are back)")


@click.command(
    "install",
    epilog=examples(
        "felixctl install",
        "felixctl --redis-url-file /run/secrets/felix-admin-url install",
        note="Run it as the default user or an administrator (it needs FUNCTION LOAD) once per deployment "
        "and after every upgrade of felix-redis (each version has its own library, felix_<digest>); "
        "Sentinel replicas and a promoted replica get it by replication, and every Cluster primary is "
        "loaded. Users holding felix-redis roles may call the library's functions (FCALL) but never load "
        "code: until it is installed their clients fail with NotInstalled.",
    ),
)
@pass_ctl
def install(ctl: Ctl) -> None:
    """Install this version's function library (every Cluster primary); prints its name."""
    name = ctl.client.load_library()
    click.echo(name)
    click.echo(f"installed: function library {name}", err=True)


@acl.command(
    "prune-libraries",
    epilog=examples(
        "felixctl acl prune-libraries",
        note="Run it as the default user or an administrator (it needs FUNCTION LIST and FUNCTION DELETE), "
        "after every client runs the new version. A client of an older version still running loads its library "
        "again on its next call where its user may, else it runs the same scripts through EVALSHA.",
    ),
)
@pass_ctl
def prune_libraries(ctl: Ctl) -> None:
    """Delete the function libraries of other felix-redis versions (every Cluster primary)."""
    removed = ctl.client.prune_libraries()
    for name in removed:
        click.echo(name)
    kept = scripts.library().name
    click.echo(f"removed {len(removed)} old function librar{'y' if len(removed) == 1 else 'ies'}; "
               f"this version's is {kept}", err=True)
