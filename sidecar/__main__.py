"""`python -m sidecar` and the `delay-sidecar` command. A stop that comes while the libraries load
is kept first (early_stop.py), before anything of weight is imported."""

from sidecar import early_stop

early_stop.install()

from sidecar.cli import main  # noqa: E402 - after the early handler, on purpose

if __name__ == "__main__":
    main()
