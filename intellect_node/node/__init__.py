"""The node: composes protocol, proofs and trainer into roles; owns host, blobs, engines and status."""
