"""The command line, a room of its own: `specdec generate | bench | bench-serve | bench-batch |
bench-forward | serve | explain | index | train | train-head` (cli.py parses and dispatches, one
module per command). The library (engine, drafting, models, serving) never imports from here."""
