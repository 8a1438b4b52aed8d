from primaplug.cli import main

raise SystemExit(main())
