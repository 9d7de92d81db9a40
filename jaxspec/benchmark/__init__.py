"""`jaxspec-bench`'s parts: prompt sets, the plain/speculative sweep, the serving run, adaptive
config choice, peer baselines, plots and the large-model cycle cost. The command is
jaxspec/bench_cli.py."""
