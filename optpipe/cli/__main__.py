from optpipe.cli.main import main

main()
