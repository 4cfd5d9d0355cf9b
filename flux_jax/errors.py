"""The one exception type for problems a user can fix: a config value, a file, a launcher setting.

Every ``python -m flux_jax.*`` command (``flux_jax.cli.run``) prints a UserError as one message,
without a traceback, and exits with status 2; any other exception keeps its traceback.
It subclasses ValueError so callers that catch ValueError keep working.
"""


class UserError(ValueError):
    """A problem the user can fix; the message names the field or file and the fix."""


def block(title: str, problems: list[str] | tuple[str, ...], footer: str = "") -> str:
    """One error message for several problems: the title, then one indented line per problem."""
    count = f"{len(problems)} problems" if len(problems) > 1 else "1 problem"
    lines = [f"{title} ({count}):"] + [f"  - {p}" for p in problems]
    return "\n".join(lines + ([footer] if footer else []))
