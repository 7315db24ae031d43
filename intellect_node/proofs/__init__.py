"""Pure tensor math for verification. Never runs a model.

``toploc`` makes and checks TOPLOC proofs (the top-k of the last hidden states, committed as a polynomial
over a prime field); ``sampling`` the log-prob and sampling checks; ``thresholds`` the acceptance
thresholds and how calibration derives them from honest runs."""
