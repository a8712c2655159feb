"""What every run shares, whatever it trains or evaluates: the machinery around the domain, not the domain.

- ``cli``: bad input as one line and exit status 2 (flags, recipes, a lost peer), never a traceback;
- ``console``: what a run prints (the warning filters, where outputs go, one line per logged step);
- ``start``: seed, logging and device sanity at the start of a script; log levels and RNG states kept around
  in-process sub-runs;
- ``training_run``: the guard sequence both training scripts run (``TrainingRun``: begin, claim, guard, train,
  complete);
- ``guard``: an ``output_dir`` is resumed only by the run that wrote it; ``hub``: the local hub (claims,
  revisions, atomic writes, consolidated exports);
- ``stop``: SIGTERM / Ctrl-C finish the step, checkpoint and exit; ``torchrun``: what a rank can tell about its
  launcher's stop grace;
- ``dependencies``: which flag needs which optional package, checked where a run starts; ``deepspeed_cpu``: what
  ZeRO needs on a GPU-less machine; ``sharding``: FSDP2 on CPU, the refused launches, parameters gathered per
  rollout round;
- ``precision``: bf16 updates that would round away are refused; ``update_monitor``: the fraction of weights that
  moved, watched during training.

Nothing in the domain packages (``envs/``, ``rewards/``) imports from here (``tests/test_import_graph.py``).
"""
