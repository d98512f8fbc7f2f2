"""cli_server.py with the peer fixtures' small DINO registered as the preset `peer-tiny` (tests/helpers/peers.py
TINY, as the in-process convert tests register it by monkeypatch), so that every command it forks can convert,
evaluate, predict from, consolidate and fine-tune a converted fixture (tests/fixtures/<peer>/)."""

import cli_server  # this folder is the script's own: sys.path[0]

from tests.helpers.peers import TINY
from vtrain.presets import DINO_PRESETS

DINO_PRESETS["peer-tiny"] = lambda: TINY

if __name__ == "__main__":
    cli_server.serve()
