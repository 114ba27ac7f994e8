from tokenbelt.cli import main

raise SystemExit(main())
