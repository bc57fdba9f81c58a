from routerd.cli import main

raise SystemExit(main())
