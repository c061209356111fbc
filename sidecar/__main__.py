from sidecar.cli import main

main()
