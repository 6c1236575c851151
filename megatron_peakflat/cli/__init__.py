"""The command lines: the planner (``plan``), ``peakflat-check`` (``check``), Megatron's pretraining with the
patches (``pretrain``) and the demo (``demo``), each run as ``python -m megatron_peakflat.<name>`` (a two-line
module beside this package) or ``python -m megatron_peakflat.cli.<name>``.

The top layer: each reads its flags and prints, over the libraries below (the planner's ``build``, ``recommend``
and ``report``, ``startup``, ``auto``, ``config``); nothing outside this package imports it
(``tests/test_layout.py``). Nothing is imported here.
"""
