"""``python -m intellect_node.config > docs/config.example.toml``: print the example configuration."""

from intellect_node.config.example import example_toml

print(example_toml(), end="")
