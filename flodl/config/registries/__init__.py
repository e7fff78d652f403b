"""The extension registries: each axis flodl grows along declared once, read by the config, the
code and the docs (docs/design/registries.md): sync modes (``modes``), link profiles
(``link_profiles``), memory-plan elements (``plan_elements``), compression codecs (``codecs``).
Pure: no torch."""
