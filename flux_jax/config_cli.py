"""The run config on the command line: ``--config FILE.py[:arg]`` plus ``--config.a.b=value`` overrides.

``parse(parser, argv)`` loads the config file, applies every override with the field's own type and
returns ``(args, config)``. Every problem (an unknown field, with the closest field names; a value
of the wrong type; a missing config file) is collected into one ``UserError``. ``--help`` with a
``--config`` lists that config's fields with their values and the comments from the config file.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import glob
import importlib.util
import os
import re
import types
from collections.abc import Sequence

import ml_collections

from flux_jax.errors import UserError, block

_PREFIX = "--config."
# Names users bring from other trainers, and the field they mean here.
_ALIASES = {
    "learning_rate": "lr",
    "batch_size": "global_batch_size",
    "max_steps": "train_iters",
    "num_steps": "train_iters",
    "steps": "train_iters",
    "warmup_steps": "lr_warmup_iters",
    "seed_value": "seed",
}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _shipped_configs() -> str:
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    names = sorted(p for p in glob.glob(os.path.join(here, "*.py")) if not p.endswith("__init__.py"))
    return ", ".join(os.path.join("configs", os.path.basename(p)) for p in names) or "configs/toy.py"


def load_config(spec: str, flag: str = "--config") -> ml_collections.ConfigDict:
    """``configs/NAME.py[:arg]`` -> the locked ConfigDict from its ``get_config(arg)``."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise UserError(
            f"{flag} {spec}: no such config file ({os.path.abspath(path)}). Pass a path such as "
            f"{_shipped_configs()}, optionally with :ARG (e.g. configs/toy.py:fp8)."
        )
    try:
        module = _load_module(path)
    except SyntaxError as err:
        raise UserError(f"{flag} {spec}: {path} line {err.lineno}: {err.msg}; fix the config file.") from None
    except OSError as err:
        raise UserError(f"{flag} {spec}: cannot read {path} ({err.strerror}).") from None
    if not callable(getattr(module, "get_config", None)):
        raise UserError(f"{flag} {spec}: {path} defines no get_config(arg); configs are .py files that do.")
    try:
        config = module.get_config(arg or None)
    except ValueError as err:  # the config's own "unknown argument" message
        raise UserError(f"{flag} {spec}: {err}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise UserError(f"{flag} {spec}: get_config returned {type(config).__name__}, not a ConfigDict.")
    config.lock()
    return config


def _load_module(path: str) -> types.ModuleType:
    name = "_flux_jax_config_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# ---- Fields --------------------------------------------------------------------------------------
def fields(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
    """Every leaf field as ``{"a.b": value}``, in the config's order."""
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out |= fields(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _initials(name: str) -> str:
    return "".join(word[0] for word in name.split("_") if word)


def suggestions(name: str, known: Sequence[str], n: int = 3) -> list[str]:
    """The known dotted fields closest to an unknown ``name``: aliases (``learning_rate`` -> ``lr``),
    initials, spelling (difflib) on the whole name and on its last part, containment, shared words."""
    leaf = name.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for field in known:
        by_leaf.setdefault(field.rsplit(".", 1)[-1], []).append(field)
    found: list[str] = []

    def add(fields_: Sequence[str]) -> None:
        found.extend(f for f in fields_ if f not in found)

    if leaf in _ALIASES:
        add(by_leaf.get(_ALIASES[leaf], []))
    add([f for f in known if f.rsplit(".", 1)[-1] == _initials(leaf) and len(leaf) > 3])
    add(difflib.get_close_matches(name, known, n=n, cutoff=0.75))
    for match in difflib.get_close_matches(leaf, list(by_leaf), n=n, cutoff=0.7):
        add(by_leaf[match])
    if len(leaf) >= 4:
        add([f for f in known if leaf in f.rsplit(".", 1)[-1] or f.rsplit(".", 1)[-1] in leaf.split("_")])
    words = {w for w in leaf.split("_") if len(w) >= 4}
    add([f for f in known if words & set(f.rsplit(".", 1)[-1].split("_"))])
    return found[:n]


def _parse_value(text: str, field_type: type, optional: bool):
    """The command-line string as the field's type; raises ValueError with what was expected."""
    if text.strip().lower() == "none" and (optional or field_type is type(None)):
        return None
    if field_type is bool:
        if text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
        raise ValueError("expected true or false")
    if field_type is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError("expected an integer") from None
    if field_type is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("expected a number") from None
    if field_type is str:
        return text
    if field_type in (tuple, list):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError("expected a tuple such as (1, 2)") from None
        if not isinstance(value, tuple | list):
            raise ValueError("expected a tuple such as (1, 2)")
        return field_type(value)
    try:  # a field without a fixed type (None by default): Python literals, else the string
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _lookup(config: ml_collections.ConfigDict, dotted: str):
    """(parent ConfigDict, leaf key) of a dotted field; KeyError when any part is missing."""
    *path, leaf = dotted.split(".")
    for part in path:
        config = config[part]
        if not isinstance(config, ml_collections.ConfigDict):
            raise KeyError(part)
    if leaf not in config:
        raise KeyError(leaf)
    return config, leaf


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Sequence[tuple[str, str]], where: str = _PREFIX
) -> None:
    """Sets each ``(dotted field, text)``; one UserError naming every bad override as the user wrote it
    (``where`` + field: ``--config.lr``, or ``--recipes bf16@lr`` for a variant's)."""
    known = list(fields(config))
    bad = []
    for name, text in overrides:
        try:
            parent, leaf = _lookup(config, name)
        except (KeyError, AttributeError):
            close = suggestions(name, known)
            hint = f" Did you mean {', '.join(f'{where}{c}' for c in close)}?" if close else ""
            bad.append(f"{where}{name}: unknown field.{hint}")
            continue
        if isinstance(parent[leaf], ml_collections.ConfigDict):
            sub = [f for f in known if f.startswith(name + ".")]
            bad.append(f"{where}{name} is a group of fields: set one of them, e.g. {where}{sub[0]}=...")
            continue
        field_type = parent.get_type(leaf)
        optional = isinstance(parent._fields[leaf], ml_collections.FieldReference)  # placeholder(type)
        try:
            value = _parse_value(text, field_type, optional)
            parent[leaf] = value
        except (ValueError, TypeError) as err:
            reason = str(err) if isinstance(err, ValueError) else f"expected {field_type.__name__}"
            bad.append(f"{where}{name}={text!r}: {reason} (the field holds {parent[leaf]!r}).")
    if bad:
        raise UserError(block("Invalid command line", bad, f"List the fields: {_FIELDS_HINT}"))


_FIELDS_HINT = "add --help after --config FILE.py to list its fields and values."


# ---- Command line --------------------------------------------------------------------------------
def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """argv without the ``--config.a.b=value`` / ``--config.a.b value`` items, and those items."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(_PREFIX):
            name, eq, text = arg[len(_PREFIX) :].partition("=")
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise UserError(f"{arg} has no value: write {arg}=VALUE.")
                text, i = argv[i + 1], i + 1
            overrides.append((name, text))
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def split_variant(spec: str, flag: str) -> tuple[str, list[tuple[str, str]]]:
    """``"NAME@field=value;other.field=value"`` -> ("NAME", [(field, text), ...]): one run variant of a
    command that trains or times several (``--recipes`` of flux_jax.convergence and benchmarks/step.py).
    The texts are typed by ``apply_overrides``; ``flag`` names the argument in errors."""
    name, _, rest = spec.partition("@")
    overrides = []
    for item in filter(None, (i.strip() for i in rest.split(";"))):
        field, eq, text = item.partition("=")
        if not eq or not field:
            raise UserError(
                f"{flag}: {item!r} in {spec!r} is not FIELD=VALUE; write e.g. "
                f"{name}@adam_moments_dtype=bfloat16;fp8_wgrad=false."
            )
        overrides.append((field.strip().removeprefix("config."), text.strip()))
    return name.strip(), overrides


def _config_spec(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def field_comments(config_path: str) -> dict[str, str]:
    """``{"a.b": comment}`` from ``x.a.b = ...  # comment`` lines: the base config's comment (what the
    field is) followed by the variant's own (why it sets that value), as "what (variant.py: why)"."""
    base = os.path.join(os.path.dirname(os.path.abspath(config_path)), "base.py")
    pattern = re.compile(r"^\s*\w+\.([\w.]+)\s*=.*?#\s*(.+)$")

    def read(path: str) -> dict[str, str]:
        out: dict[str, str] = {}
        with open(path) as f:
            for line in f:
                if m := pattern.match(line):
                    out.setdefault(m.group(1), m.group(2).strip())
        return out

    own = read(config_path)
    if not os.path.exists(base) or os.path.samefile(base, config_path):
        return own
    name = os.path.basename(config_path)
    out = read(base)
    for field, why in own.items():
        out[field] = f"{out[field]} ({name}: {why})" if field in out else why
    return out


def fields_help(spec: str) -> str:
    """The fields of config ``spec`` with values and comments, for ``--help``."""
    config = load_config(spec)
    comments = field_comments(spec.partition(":")[0])
    rows = [(f"--config.{k}={v}", comments.get(k, "")) for k, v in fields(config).items()]
    width = min(max(len(r[0]) for r in rows), 48)
    lines = [f"  {flag:<{width}}  {text}".rstrip() for flag, text in rows]
    return f"Fields of {spec} (value shown is its default):\n" + "\n".join(lines)


CONFIG_HELP = (
    "Config: --config FILE.py[:ARG] picks a config (e.g. configs/toy.py, configs/flux_535m.py:fp8); any\n"
    "field is overridden with --config.FIELD=VALUE, nested fields by their dotted name:\n"
    "  --config.lr=3e-4 --config.train_iters=1000 --config.data.image_size=256 --config.fp8=None\n"
    "Every field is commented in the config file; add --help after --config FILE.py to list them here."
)


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, metavar="FILE.py[:ARG]", help="run config, e.g. configs/toy.py:fp8"
    )


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.Namespace, object]:
    """Parses argv with ``parser`` (which has ``--config``, see add_config_argument) and the overrides.

    Returns ``(args, config)`` with the overrides applied (``--config.fp8=None`` gives None).
    """
    rest, overrides = split_overrides(argv)
    if any(a in ("-h", "--help") for a in rest):
        spec = _config_spec(rest)
        epilog = CONFIG_HELP + ("\n\n" + fields_help(spec) if spec else "")
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.epilog = epilog
        parser.parse_args(["--help"])  # prints and exits 0
    args = parser.parse_args(rest)
    config = load_config(args.config)
    apply_overrides(config, overrides)
    return args, config
