import sys

from ..cli import main

main(["bench", *(sys.argv[1:] or ["fused_linear"])])
