"""Content-addressed blobs: the chunk and manifest store (``store``), the bulk HTTP server (``http``)
and its seed pacing (``pacing``), multi-provider parallel fetch with per-chunk hash checks (``fetch``),
which peer addresses a node fetches from (``addresses``: a peer's URL may only lead back to that peer),
the node service that ties them to the swarm (``service``) and a bare blob peer process for tests and
benchmarks (``peer``).
May import: ``errors``, ``fsutil``, ``aioutil``, ``protocol``."""
