from cosmos3_batch.cli import main

main()
