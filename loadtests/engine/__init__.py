"""SGLang prefill/decode (PD) engine emulator, including the 0.5.8 KV-leak bug (see loadtests/README.md).

Run a server with `python -m loadtests.engine --role prefill|decode ...`; start one from Python with
`loadtests.engine.harness.start_engine` / `start_pair`.
"""
