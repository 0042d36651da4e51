from joulepilot.cli import main

main()
