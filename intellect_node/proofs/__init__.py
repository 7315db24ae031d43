"""Pure tensor math for verification (TOPLOC, logprob and sampling checks). Never runs a model."""
