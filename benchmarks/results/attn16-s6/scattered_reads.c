// The scattered-read loop of docs/benchmarks.md ("Paged decode attention with a cold KV
// cache"): gcc -O2 scattered_reads.c && ./a.out 200 (arithmetic steps per chunk).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
#define NBLK 16384
#define CH 2048
#define N 624
static double now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int argc,char**argv){
  int work = atoi(argv[1]);
  char* kv = aligned_alloc(4096,(size_t)NBLK*CH*2); memset(kv,1,(size_t)NBLK*CH*2);
  float* fl = aligned_alloc(64, 96<<20); for(size_t i=0;i<(24<<20);i++) fl[i]=1;
  int idx[N]; srand(1); for(int i=0;i<N;i++) idx[i]=rand()%NBLK;
  int dists[] = {0,1,4,8,16};
  for (int rep=0; rep<5; rep++) for (int di=0; di<5; di++) {
    int d = dists[di]; double best=1e18, tot=0;
    for (int it=0; it<20; it++) {
      volatile float s=0; for(size_t i=0;i<(24<<20);i+=16) s+=fl[i];
      double t0=now(); float acc=0;
      for (int i=0;i<N;i++){
        if (d && i+d<N) { const char* p=kv+(size_t)idx[i+d]*CH*2; for(int o=0;o<CH*2;o+=64) __builtin_prefetch(p+o); }
        const float* p=(const float*)(kv+(size_t)idx[i]*CH*2);
        for(int j=0;j<CH*2/4;j+=16) acc+=p[j];
        float x=acc; for(int w=0;w<work;w++) x=x*0.999f+1.0f; acc+=x*1e-9f;
      }
      double dt=now()-t0; tot+=dt; if(dt<best)best=dt; if(acc==12345)printf("x");
    }
    printf("dist %2d: mean %.0f us best %.0f\n", d, tot/20, best);
  }
}
