"""The commented example configuration (``docs/config.example.toml``), made from the schema's docstrings.

Regenerate it with ``python -m intellect_node.config > docs/config.example.toml``; a test checks
that the file documents every field.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from intellect_node.config.schema import NodeConfig, section_models


def field_docs(model: type[BaseModel] = NodeConfig, prefix: str = "") -> dict[str, str]:
    """``section.field`` -> its docstring, for every field of the tree ("" where one is missing)."""
    out: dict[str, str] = {}
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(field_docs(ann, path))
        else:
            out[path] = info.description or ""
    return out


def example_toml() -> str:
    """A complete, commented config with every field at its default (docs/config.example.toml)."""
    import textwrap

    lines = ["# intellect-node configuration: every field, at its default, with what it does.",
             "# Use: intellect-node join --config FILE (or INTELLECT_NODE_CONFIG=FILE, or "
             "<data-dir>/config.toml).",
             "# Environment variables override the file: INTELLECT_NODE_<SECTION>__<FIELD>, e.g.",
             "#   INTELLECT_NODE_NETWORK__BOOTSTRAP=/ip4/1.2.3.4/tcp/4001/p2p/12D3KooW...",
             "# and command-line flags override both. Unknown fields are errors.",
             "# Regenerate: python -m intellect_node.config > docs/config.example.toml", ""]
    defaults = NodeConfig()
    for section, model in section_models().items():
        doc = (NodeConfig.model_fields[section].description or "").strip()
        lines.append(f"[{section}]" + (f"  # {doc}" if doc else ""))
        values = getattr(defaults, section)
        for name, info in model.model_fields.items():
            for para in (info.description or "").strip().splitlines():
                lines += [f"# {w}" for w in textwrap.wrap(" ".join(para.split()), 100)] or ["#"]
            value = getattr(values, name)
            if value is None:
                lines.append(f"# {name} =")
            else:
                lines.append(f"{name} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)

