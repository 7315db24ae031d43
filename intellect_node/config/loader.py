"""Where a node's configuration comes from and what an operator is told when it is wrong.

:func:`load_config` layers a TOML file, ``INTELLECT_NODE_<SECTION>__<FIELD>`` environment variables and
flags (flags > env > file). :func:`build_config` turns pydantic's errors into one :class:`ConfigError`
that names the field (``network.bootstrap[0]``) and what is wrong with it; :func:`load_config` adds
where the value came from.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ValidationError

from intellect_node.config.schema import NodeConfig, section_models
from intellect_node.errors import ConfigError


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _known_fields(loc: tuple[int | str, ...]) -> str:
    """"expected one of ..." for the model that refused an unknown key at ``loc``."""
    model: type[BaseModel] = NodeConfig
    for part in loc[:-1]:
        info = model.model_fields.get(part) if isinstance(part, str) else None
        if info is None or not (isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)):
            return "check its spelling"
        model = info.annotation
    return "expected one of: " + ", ".join(model.model_fields)


def build_config(data: Mapping[str, object] | None = None, **sections: object) -> NodeConfig:
    """Validate a config dict (``{"network": {...}, "run": {...}}``); ConfigError names the field."""
    merged: dict[str, object] = dict(data or {})
    merged.update(sections)
    try:
        return NodeConfig.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = _loc(err["loc"]) or "config"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; {_known_fields(err['loc'])}"
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        # a check across sections (a model validator) has no location: its message names the fields
        where = f"config field {field}" if err["loc"] else "config"
        raise ConfigError(f"{where}: {msg}{more}", field=field) from exc


# -- files, environment and flags ------------------------------------------------------------------
#
# One TOML file (the schema's sections), then INTELLECT_NODE_<SECTION>__<FIELD> environment variables,
# then command-line flags: each layer overrides the one before, field by field. A mistake names the
# field, where the value came from (the file, the variable or the flag) and what was expected.

ENV_PREFIX = "INTELLECT_NODE_"
CONFIG_ENV = "INTELLECT_NODE_CONFIG"
"""Path of the config file when ``--config`` is not given."""
DEFAULT_CONFIG_NAME = "config.toml"
"""Read from the data dir when neither ``--config`` nor ``INTELLECT_NODE_CONFIG`` names a file."""
MAX_CONFIG_BYTES = 1 << 20


def read_toml(path: str | Path) -> dict[str, object]:
    """The TOML file at ``path`` as a dict; ConfigError (field ``config``) for a missing or broken file."""
    import tomllib

    path = Path(path).expanduser()
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(f"--config {path}: no such file; docs/config.example.toml is a template",
                          field="config") from exc
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})", field="config") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"--config {path}: {len(raw)} bytes is not a config file", field="config")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}", field="config") from exc


def toml_table(doc: Mapping[str, object], name: str) -> dict[str, object]:
    """A copy of the table ``[name]`` of a file :func:`read_toml` read ({} when absent); ConfigError (field
    ``name``) when ``name`` is not a table."""
    table = doc.get(name, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"config {name}: expected a table ([{name}]), got {type(table).__name__}",
                          field=name)
    return dict(table)


def _env_value(raw: str, annotation: object) -> object:
    """Text of an environment variable -> a value pydantic validates: JSON where it parses as a list or
    object, comma-separated lists, empty text as "unset" (None) for optional fields."""
    text = raw.strip()
    origin = getattr(annotation, "__origin__", None)
    if origin is list or annotation is list:
        if text.startswith("["):
            try:
                return json.loads(text)
            except ValueError:
                return text  # pydantic reports it as "not a list" with the field's name
        return [part.strip() for part in text.split(",") if part.strip()]
    if text == "" and type(None) in getattr(annotation, "__args__", ()):
        return None
    return text


def _nearest_field(model: type[BaseModel], name: str) -> str | None:
    """The field of ``model`` a mistyped ``name`` most likely means: the name itself, a field that ends or
    starts with it ("id" means run_id more often than difflib would guess), else the closest spelling."""
    fields = list(model.model_fields)
    if name in fields:
        return name
    near = [f for f in fields if name and (f.endswith("_" + name) or f.startswith(name + "_"))]
    near = near or difflib.get_close_matches(name, fields, n=1)
    return near[0] if near else None


def env_layer(environ: Mapping[str, str]) -> tuple[dict[str, dict[str, object]], dict[str, str]]:
    """Config values from ``INTELLECT_NODE_<SECTION>__<FIELD>`` variables, and field -> variable name."""
    sections = section_models()
    values: dict[str, dict[str, object]] = {}
    origin: dict[str, str] = {}
    for var, raw in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX) or var == CONFIG_ENV:
            continue
        rest = var[len(ENV_PREFIX):]
        if "__" not in rest:
            head = rest.split("_", 1)[0].lower()
            if head in sections and rest.lower() != head:
                tail = rest.split("_", 1)[1].lower()
                field = _nearest_field(sections[head], tail) or tail
                raise ConfigError(f"environment variable {var}: config variables separate section and field "
                                  f"with two underscores, e.g. {ENV_PREFIX}{head.upper()}__"
                                  f"{field.upper()}", field=var)
            continue  # INTELLECT_NODE_DATA_DIR and other non-config variables
        section, _, name = rest.lower().partition("__")
        model = sections.get(section)
        if model is None:
            raise ConfigError(f"environment variable {var}: no config section {section!r} (sections: "
                              f"{', '.join(sections)})", field=var)
        info = model.model_fields.get(name)
        if info is None:
            near = _nearest_field(model, name)
            hint = f"; did you mean {ENV_PREFIX}{section.upper()}__{near.upper()}?" if near else ""
            raise ConfigError(f"environment variable {var}: section {section} has no field {name!r}{hint} "
                              f"(fields: {', '.join(model.model_fields)})", field=var)
        values.setdefault(section, {})[name] = _env_value(raw, info.annotation)
        origin[f"{section}.{name}"] = var
    return values, origin


def deep_merge(base: Mapping[str, object], over: Mapping[str, object]) -> dict[str, object]:
    """``over`` on top of ``base``: tables merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping):
            out[key] = deep_merge(below, value)
        else:
            out[key] = value
    return out


def _leaves(d: Mapping[str, object], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        out += (_leaves(v, path) or [path]) if isinstance(v, Mapping) else [path]
    return out


def config_file_for(path: str | Path | None, *, environ: Mapping[str, str],
                    data_dir: Path | None) -> Path | None:
    """``--config`` beats ``INTELLECT_NODE_CONFIG`` beats ``<data-dir>/config.toml`` (if it exists)."""
    if path:
        return Path(path).expanduser()
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV]).expanduser()
    if data_dir is not None and (data_dir / DEFAULT_CONFIG_NAME).is_file():
        return data_dir / DEFAULT_CONFIG_NAME
    return None


def config_layers(path: str | Path | None = None, *, flags: Mapping[str, object] | None = None,
                  environ: Mapping[str, str] | None = None, data_dir: Path | None = None,
                  flag_names: Mapping[str, str] | None = None
                  ) -> tuple[Path | None, dict[str, object], dict[str, str]]:
    """The layers merged but not validated: ``(file read or None, values, origin)`` where ``origin`` maps
    each ``section.field`` that was set to where (the file's path, the variable, the flag); a field
    absent from ``origin`` keeps its default. ``intellect-node config show`` prints the same origins."""
    environ = os.environ if environ is None else environ
    file = config_file_for(path, environ=environ, data_dir=data_dir)
    layers: list[tuple[Mapping[str, object], dict[str, str]]] = []
    if file is not None:
        doc = read_toml(file)
        layers.append((doc, {leaf: f"{file}" for leaf in _leaves(doc)}))
    layers.append(env_layer(environ))
    if flags:
        names = flag_names or {}
        layers.append((dict(flags),
                       {leaf: names.get(leaf, "a command-line flag") for leaf in _leaves(flags)}))
    merged: dict[str, object] = {}
    origin: dict[str, str] = {}
    for values, where in layers:
        merged = deep_merge(merged, values)
        origin.update(where)
    return file, merged, origin


def load_config(path: str | Path | None = None, *, flags: Mapping[str, object] | None = None,
                environ: Mapping[str, str] | None = None, data_dir: Path | None = None,
                flag_names: Mapping[str, str] | None = None) -> NodeConfig:
    """Build the node's config: file < environment < flags (``flags`` holds only flags actually given,
    as ``{"network": {"bootstrap": [...]}}``). ``flag_names`` maps ``section.field`` to its flag so an error
    names ``--bootstrap`` rather than the field. ConfigError names the field and the value's source."""
    _file, merged, origin = config_layers(path, flags=flags, environ=environ, data_dir=data_dir,
                                          flag_names=flag_names)
    try:
        return build_config(merged)
    except ConfigError as exc:
        field = exc.field or ""
        source = next((src for leaf, src in origin.items()
                       if field == leaf or field.startswith((leaf + "[", leaf + "."))), None)
        if source is None:  # a whole-section check (e.g. peer_timeout vs heartbeat_interval)
            source = next((src for leaf, src in origin.items() if leaf.startswith(field + ".")), None)
        if source is None:
            raise
        raise ConfigError(f"{exc} (set in {source})", field=field) from exc

