"""One prefill/decode exchange: dispatch, verify-then-release, the cancel order, aborts."""
