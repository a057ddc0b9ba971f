#!/usr/bin/env python3
# Independent reference for the stability guard in shuffle.rs: `python3 shuffle_reference.py`
# prints the permutation prefixes pinned in `permutation_prefix_is_stable`.
# Independent reference of burn_ddp::data::shuffle: ChaCha8 (djb layout, 64-bit counter,
# 64-bit stream id 0), key = seed LE in bytes 0..8, next_u64 = low word first, Lemire bounded,
# Fisher-Yates from the top.
import struct, sys
M=0xffffffff
def rotl(v,c): return ((v<<c)&M)|(v>>(32-c))
def qr(x,a,b,c,d):
    x[a]=(x[a]+x[b])&M; x[d]=rotl(x[d]^x[a],16)
    x[c]=(x[c]+x[d])&M; x[b]=rotl(x[b]^x[c],12)
    x[a]=(x[a]+x[b])&M; x[d]=rotl(x[d]^x[a],8)
    x[c]=(x[c]+x[d])&M; x[b]=rotl(x[b]^x[c],7)
def block(key,counter):
    s=[0x61707865,0x3320646e,0x79622d32,0x6b206574]+list(struct.unpack('<8I',key))+[counter&M,counter>>32,0,0]
    x=s[:]
    for _ in range(4):
        qr(x,0,4,8,12);qr(x,1,5,9,13);qr(x,2,6,10,14);qr(x,3,7,11,15)
        qr(x,0,5,10,15);qr(x,1,6,11,12);qr(x,2,7,8,13);qr(x,3,4,9,14)
    return [(x[i]+s[i])&M for i in range(16)]
class Rng:
    def __init__(s,seed):
        s.key=struct.pack('<Q',seed)+bytes(24); s.ctr=0; s.buf=[]
    def u32(s):
        if not s.buf: s.buf=block(s.key,s.ctr); s.ctr+=1
        return s.buf.pop(0)
    def u64(s):
        lo=s.u32(); hi=s.u32(); return lo|(hi<<32)
def bounded(r,n):
    t=((1<<64)-n)%n
    while True:
        m=r.u64()*n
        if (m & ((1<<64)-1))>=t: return m>>64
def perm(n,seed):
    o=list(range(n)); r=Rng(seed)
    for i in range(n-1,0,-1):
        j=bounded(r,i+1); o[i],o[j]=o[j],o[i]
    return o
print(perm(10,0))
print(perm(1000,42)[:12])
print(perm(60000,(1<<64)-1)[:8])
