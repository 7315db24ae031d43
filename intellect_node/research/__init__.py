"""Research workloads run by the swarm (pure compute, no networking), e.g. incidental polysemanticity."""
