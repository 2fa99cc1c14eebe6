from moeprep.cli import main

main()
