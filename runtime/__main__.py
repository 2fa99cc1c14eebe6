from moerun.cli import main

main()
