import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the CLI's modules load
    print("patchkv: error: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

main()
