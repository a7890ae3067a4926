"""`dspark export`: the vLLM-loadable folder (folder.py) and its model card (card.py, provenance.py, commands.py).

May import eval's reports, train's config, kinds, settings, the connector's registry (whether a run's source was live)
and dspark's ground floor; never decode or the CLI.
"""
