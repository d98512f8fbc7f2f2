# `python -m vtrain` and `accelerate launch -m vtrain` enter here.
from vtrain.cli import main

main()
