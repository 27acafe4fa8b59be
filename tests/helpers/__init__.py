"""Builders the test files share, one module per kind of thing built: import them from here, never from another
test file (``conftest.py`` keeps the fixtures).

- :mod:`helpers.models`: small models with fixed seeds (an MLP, a tiny Llama), and comparing their weights.
- :mod:`helpers.batches`: batches for them (regression pairs, causal-LM ids, ragged padded text).
- :mod:`helpers.batch_trees`: nested batches drawn by hypothesis, and the check that split parts rejoin.
- :mod:`helpers.steps`: step functions and whole guarded or unguarded training runs.
- :mod:`helpers.optimizers`, :mod:`helpers.devices`, :mod:`helpers.events`: an SGD that records its gradients, a
  simulated GPU that counts its allocations, the first event of a kind.
- :mod:`helpers.scenarios`: client code the project did not write (GPT-2, a PEFT LoRA Llama, a nanoGPT).
- :mod:`helpers.hf_trainer`, :mod:`helpers.trl_example`: the Hugging Face Trainer's and TRL's setups.
- :mod:`helpers.launch`, :mod:`helpers.sweep`, :mod:`helpers.hostsweep`: two-rank gloo jobs, the fault-sweep
  harness, and its host faults (a failed host allocation on an offload rung's plan).
"""
