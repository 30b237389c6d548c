from moe_eplb.cli import main

main()
