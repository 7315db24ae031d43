"""Research workloads run by the swarm (pure compute, no networking), e.g. incidental polysemanticity
(``polysemanticity``); ``sweep/`` farms many small training runs out to the swarm, one module per concern."""
