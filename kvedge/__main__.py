from kvedge.cli import main

main()
