from diloco.cli import main

main()
