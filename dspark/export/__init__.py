"""`dspark export`: the vLLM-loadable folder (folder.py) and its model card (card.py, provenance.py, commands.py).

Imports: connector (whether a run's source was live), core, kinds, train (its config and checkpoints), verifier.
"""
