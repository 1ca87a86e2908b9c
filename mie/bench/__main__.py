"""``python -m mie.bench`` -- for now, a demonstration of the paged memory layer."""

from mie import BlockPool, BlockTable


def main() -> None:
    block_size, num_blocks = 16, 64
    pool = BlockPool(num_blocks, bytes_per_block=block_size * 2)
    system = BlockTable(pool, block_size)
    system.append_tokens(100)
    print(f"system prompt: 100 tokens in {system.num_blocks} blocks {system.blocks}")
    users = []
    for i in range(4):
        t = BlockTable(pool, block_size)
        t.borrow_prefix(system, 100)
        t.append_tokens(20 + 10 * i)
        t.writable_block(100)  # the first write splits the shared partial block
        users.append(t)
        print(f"request {i}: {t.num_tokens} tokens, blocks {t.blocks}")
    used = num_blocks - pool.num_free
    unshared = system.num_blocks * 5 + sum(t.num_blocks - system.num_blocks for t in users)
    print(
        f"blocks in use: {used} (without sharing: {unshared}); utilisation {pool.utilization:.0%}"
    )
    for t in [system, *users]:
        t.release()
    print(f"after release: {pool.num_free}/{num_blocks} blocks free")


if __name__ == "__main__":
    main()
